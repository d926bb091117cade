"""The launch-script reader against bash itself: the arguments bash hands a stub ``torchrun`` are the ones
``read_command`` finds, on Megatron-LM's example scripts and on scripts written to exercise each construct."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from search.io.errors import AcesoError
from search.megatron.shell import read_command
from tests.unit.megatron_examples import example_text

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

CONSTRUCTS = {
    "appends-and-quotes": '''
A=(--num-layers 4)     # a comment
A+=(--hidden-size 64 "--seq-length 128")
B="--micro-batch-size
 2"
X=${UNSET:-7}; Y=${X:+set}
export N=2
torchrun --nproc_per_node $((N*4)) pretrain_gpt.py "${A[@]}" $B --lr "${X}e-4" ${A[*]} --x=$Y \\
    --name 'a b' --tab "$(printf x)x" 2>&1 | tee log
''',
    "if-and-chain": '''
MODE=big
if [[ "$MODE" == "small" ]]; then
  L=2
elif [ "$MODE" = big ] && [ -z "$NOT_SET" ]; then
  L=48
else
  L=1
fi
[ -n "$L" ] && EXTRA="--swiglu" || EXTRA=""
[ "$L" -gt 100 ] && EXTRA="--wrong"
torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers $L $EXTRA
''',
    "sh-c": '''
CMD="python -u pretrain_gpt.py --num-layers 3 --hidden-size 8"
sh -c "${CMD}"
''',
    # issue 32: an array inside a string joins its elements with spaces (aceso read --num-layers2--hidden-size256)
    "array-in-a-string": '''
ARGS=(--num-layers 2 --hidden-size 256 "--name a b")
CMD="torchrun --nproc-per-node 8 pretrain_gpt.py ${ARGS[@]} --bf16"
D=${UNSET:-"x${ARGS[@]}y"}
E="${ARGS[*]}"
$CMD --d "$D" --e "$E"
''',
    # issue 32: loops that only print, one fed by a process substitution (was "a redirection without a target")
    "loops-that-only-print": r'''
while read -r line; do echo "$line"; done < <(printf 'a\nb\n')
for x in 1 2 3; do
  echo "step $x"
done
until true; do echo never; done
diff <(echo a) <(echo a) > /dev/null
torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 64
''',
    # aceso's own export: TOKENIZER_ARGS=(${TOKENIZER_ARGS:-...}) is an environment override with a default of words
    "default-of-words": '''
T=(${T:---tokenizer-type NullTokenizer --vocab-size 99})
D=${D:---mock-data}
torchrun --nproc_per_node 8 pretrain_gpt.py "${T[@]}" $D "${U:-a b}" ${U:-c  d} "${U:-$D e}"
''',
}


def _bash_argv(text: str, tmp_path, args=()) -> list[str]:
    """The argv bash gives the last torchrun / python / sh call, from stubs on PATH (an empty environment)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("torchrun", "python", "sh"):
        stub = bin_ / name
        stub.write_text('#!/bin/bash\nif [ "$1" = -c ]; then exec /bin/bash -c "$2"; fi\n'
                        'printf "%s\\0" "$@" > "$ACESO_OUT"\n')
        stub.chmod(0o755)
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "run.sh").write_text(text)
    out = tmp_path / "argv"
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "ACESO_OUT": str(out), "HOME": str(tmp_path)}
    subprocess.run(["/bin/bash", "run.sh", *args], cwd=tmp_path, env=env, capture_output=True, timeout=60)
    return out.read_bytes().decode().split("\0")[:-1]


def _after_py(argv: list[str]) -> list[str]:
    k = max(i for i, w in enumerate(argv) if w.endswith(".py"))
    return argv[k + 1:]


@pytest.mark.parametrize("name", sorted(CONSTRUCTS))
def test_constructs_as_bash_expands_them(name, tmp_path):
    text = CONSTRUCTS[name]
    got = read_command(text)
    want = _after_py(_bash_argv(text, tmp_path))
    if name == "appends-and-quotes":             # bash ran the command substitution; aceso keeps it a placeholder
        i = want.index("--tab")
        assert want[i + 1] == "xx" and got.argv[i + 1] == "<cmd:$(printf\0x)>x"
        want[i + 1] = got.argv[i + 1]
        assert got.world_size == 8
    assert got.argv == want


@pytest.mark.parametrize("rel", ["llama/train_llama3_8b_h100_fp8.sh", "t5/train_t5_220m_distributed.sh",
                                 "mixtral/train_mixtral_8x7b_distributed.sh", "gpt3/train_gpt3_175b_distributed.sh",
                                 "bert/train_bert_340m_distributed.sh"])
def test_example_scripts_as_bash_runs_them(rel, tmp_path):
    text = example_text(rel)
    for name in ("pretrain_t5.py", "pretrain_bert.py"):
        (tmp_path / name).write_text("")
    got = read_command(text)
    # aceso keeps the script's unset arguments $1.. as placeholders: bash gets them as arguments with those names
    # (the llama script has defaults for them and runs without); bash sets PWD
    args = [] if "${1:-" in text else [f"<unset:{i}>" for i in range(1, 10)]
    want = [w.replace(str(tmp_path), "<unset:PWD>") for w in _after_py(_bash_argv(text, tmp_path, args))]
    assert got.argv == want


@pytest.mark.parametrize("text, needle", [
    ("while true; do torchrun pretrain_gpt.py; done", "line 1: a 'while' loop that sets variables or runs the "
                                                     "command"),
    ("for L in 2 4; do N=$L; done\ntorchrun pretrain_gpt.py --num-layers $N", "line 1: a 'for' loop that sets"),
    ("f() { torchrun pretrain_gpt.py; }\nf", "a function definition (f() ...)"),
    ("eval torchrun pretrain_gpt.py", "'eval'"),
    ("cat <<EOF\n--num-layers 2\nEOF", "a here-document"),
    ("if [ -f x ]; then L=2; fi\ntorchrun pretrain_gpt.py --num-layers $L", "line 1: an 'if' whose test cannot be "
                                                                           "decided"),
    ("A=(--num-layers 2\ntorchrun pretrain_gpt.py", "never closed with ')'"),
    ("echo 'oops", "line 1: a single quote (') is never closed"),
])
def test_unreadable_constructs_are_refused_with_their_line(text, needle):
    with pytest.raises(AcesoError, match=None) as e:
        read_command(text, "run.sh")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_loop_variable_is_not_guessed():
    """After a skipped loop its variable holds what the last pass left (bash: 3); aceso does not run the loop, so
    the value is a placeholder a plan flag reports, not the empty string."""
    got = read_command("for L in 1 2 3; do echo $L; done\ntorchrun pretrain_gpt.py --num-layers $L")
    assert got.argv[1].startswith("<expr:$L") and got.notes == ["line 1: skipped a 'for' loop (it only prints)"]


@pytest.mark.parametrize("text, needle", [
    ('#!/bin/bash\nset -e\nbash ./train_llama.sh "$@"\n', "line 3: runs another script, ./train_llama.sh: aceso "
                                                           "reads one launch script"),
    ("sbatch job.sbatch\n", "line 1: runs another script, job.sbatch"),
    ("NGPU=8\ntorchrun --nproc_per_node=${NGPU} --rdzv_backend c10d -m torchtitan.train --job.config_file x.toml\n",
     "line 2: runs torchtitan.train (torchrun -m torchtitan.train): not a Megatron-LM pretraining entry point"),
    ("python -m megatron.inference.text_generation_server --num-layers 2\n",
     "(python -m megatron.inference.text_generation_server): inference / text generation"),
    ("mkdir -p out\nmy_trainer --layers 4\n", "line 2: runs my_trainer, and no command runs Megatron-LM's "
                                              "pretrain_gpt.py"),
    ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\ntorchrun --nproc-per-node 8 pretrain_gpt.py "
     "--num-layers 4\n", "runs pretrain_gpt.py 2 times with different arguments (lines 1, 2)"),
])
def test_what_a_file_runs_instead_is_named(text, needle):
    with pytest.raises(AcesoError) as e:
        read_command(text, "run.sh")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_same_command_twice_is_priced_once_with_a_note():
    line = "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n"
    got = read_command(line + "echo retry\n" + line, "run.sh")
    assert got.argv == ["--num-layers", "2"]
    assert got.notes == ["the same command runs 2 times (lines 1, 3); priced once"]


def test_an_unquoted_pattern_cut_is_a_pipe_and_said_so():
    """``--hybrid-layer-pattern MEM*|EME`` unquoted (as Megatron-LM's test YAMLs write the value) is a pipe into a
    program ``EME`` to bash itself (the reference: bash runs it and cannot find that command); aceso says so and how
    to quote it, in one line. Before: "--hidden-size is missing" (the flags after the '|' belong to the program
    ``EME``), or "runs EME, and no command runs Megatron-LM's pretrain_gpt.py ...", naming no '|'."""
    import subprocess

    line = "torchrun pretrain_hybrid.py --hybrid-layer-pattern MEM*|EME --hidden-size 64"
    bash = subprocess.run(["bash", "-c", line.replace("torchrun pretrain_hybrid.py", "true")], capture_output=True,
                          text=True)
    assert "EME: command not found" in bash.stderr
    for text in (line, line.split(" ", 2)[2]):
        with pytest.raises(AcesoError) as e:
            read_command(text, "run.sh")
        msg = str(e.value)
        assert "'|' outside quotes pipes the command into EME" in msg and "quote the --hybrid-layer-pattern" in msg
        assert "\n" not in msg
