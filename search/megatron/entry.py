"""The entry point of a launch script: aceso prices what ``pretrain_gpt.py`` and ``pretrain_t5.py`` (core_v0.16.1)
run, and ``pretrain_hybrid.py`` / ``pretrain_mamba.py`` hybrid-pattern runs (core_v0.17 on, ``hybrid_pattern.py``);
any other Megatron-LM program is refused with what it is, in one line.

``script_names`` finds the ``.py`` files a script names anywhere (also inside a loop or an ``if`` it cannot read),
so a script is refused for what it runs before it is refused for how it is written.
"""

from __future__ import annotations

import re

from search.io.errors import AcesoError

PRICED = ("pretrain_gpt.py", "pretrain_t5.py")
HYBRID_ENTRIES = ("pretrain_hybrid.py", "pretrain_mamba.py")   # read as hybrid-pattern runs (hybrid_pattern.py)
READ = PRICED + HYBRID_ENTRIES     # every entry point whose run a launch script's other commands stand beside


def entry_list(last: str = "or") -> str:
    """The entry points aceso reads, as a refusal's fix names them ("pretrain_gpt.py, ... or pretrain_mamba.py")."""
    return f"{', '.join(READ[:-1])} {last} {READ[-1]}"


class EntryRefusal(AcesoError):
    """The script runs something aceso does not price (said in one line): final, not a reading failure."""

# (pattern on the script's path, what it is)
_KINDS = (
    (r"pretrain_bert\.py$", "BERT pretraining (pretrain_bert.py), which aceso does not price"),
    (r"mimo/\w+\.py$|pretrain_mimo\.py$",
     "a MIMO multimodal model (megatron-core's MimoModel: modality encoders around a language model), which aceso "
     "does not price; price its language model's run as pretrain_gpt.py arguments"),
    (r"pretrain_vlm\.py$", "a vision-language model (pretrain_vlm.py: a vision encoder and projector before the "
                            "language model), which aceso does not price; price its language model's run as "
                            "pretrain_gpt.py arguments"),
    (r"pretrain_(ict|retro|vision\w*)\.py$|multimodal/train\.py$",
     "a multimodal / vision-language model, which aceso does not price"),
    (r"text_generation|inference|generate\w*\.py$|_cli\.py$|(^|/)(static|dynamic)_\w*\.py$",
     "inference / text generation, not training; aceso plans training runs"),
    (r"preprocess\w*\.py$|data_processing", "data preprocessing, not training"),
    (r"post_training|modelopt|(convert\w*|export|quantize|prune|mmlu|validate|offline_feature_extract|"
     r"checkpoint_converter|combine_state_dicts)\.py$",
     f"a checkpoint / post-training (ModelOpt) tool, not pretraining; aceso plans {entry_list('and')} runs"),
    (r"finetune\w*\.py$|tasks/.*main\.py$", "a fine-tuning or task script whose model and data path aceso cannot "
                                             "read; price its run as pretrain_gpt.py arguments"),
)


def what_it_runs(script: str) -> str:
    for pattern, what in _KINDS:
        if re.search(pattern, script):
            return what
    return f"not a Megatron-LM pretraining entry point aceso prices ({', '.join(READ)})"


def refuse_entry(script: str, source: str):
    raise EntryRefusal(f"{source}: runs {script}: {what_it_runs(script)}")


# commands a launch script runs around its launcher that change nothing aceso reads
_HARMLESS = frozenset({"echo", "printf", "set", "cd", "pushd", "popd", "mkdir", "exit", "ulimit", "trap", "shift",
                       "umask", "sleep", "wait", "date", "hostname", "nvidia-smi", "env", "rm", "cp", "touch", "ls",
                       "cat", "tee", "true", "false", ":"})
_LAUNCHERS = ("torchrun", "python", "python3", "deepspeed", "accelerate")
_RUNNERS = ("bash", "sh", "zsh", "source", ".", "sbatch", "srun", "exec", "nohup")
# launcher modules (``python -m torch.distributed.launch x.py``): what they run is the next script, not them
_LAUNCH_MODULES = ("torch.distributed.launch", "torch.distributed.run")
# environment runners that run a command in a project environment: ``uv run [OPTIONS] python ...`` (Megatron-LM
# core_v0.19.0's examples/mimo/scripts/run_hetero_nemotron_20l_mock_train.sh); the launcher after them is the command
_ENV_RUNNERS = {"uv": "run"}


def check_no_entry(commands: list[tuple[list[str], int]], source: str) -> None:
    """A file whose commands run no ``.py`` file: it is an argument line (every command starts with a flag), or
    it is refused for what it runs instead (another script, a ``-m`` module, another program), in one line."""
    for argv, line in commands:
        if not argv or argv[0].startswith("-") or harmless(argv) or re.match(r"<(unset|cmd|expr):", argv[0]):
            continue
        argv = _unwrap(argv)
        prog = argv[0].rsplit("/", 1)[-1]
        module = _module(argv) if prog.startswith(_LAUNCHERS) else None
        if module:
            raise EntryRefusal(f"{source}: line {line}: runs {module} ({prog} -m {module}): "
                             f"{what_it_runs(module.replace('.', '/') + '.py')}")
        script = _script_run(argv) if prog in _RUNNERS or prog.startswith(_LAUNCHERS) else \
            (argv[0] if argv[0].endswith(".sh") else None)
        if script:
            raise EntryRefusal(f"{source}: line {line}: runs another script, {script}: aceso reads one launch script "
                             f"without running it; give the script that runs {entry_list()} (or its "
                             "arguments)")
        raise EntryRefusal(f"{source}: line {line}: runs {prog}, and no command runs Megatron-LM's {entry_list()}; "
                         "give that launch script (or its arguments)")


def _unwrap(argv: list[str]) -> list[str]:
    """The launcher command an environment runner runs (``uv run --extra ssm python -m ...`` -> ``python -m ...``),
    else ``argv``."""
    if len(argv) > 2 and _ENV_RUNNERS.get(argv[0].rsplit("/", 1)[-1]) == argv[1]:
        for i, w in enumerate(argv[2:], start=2):
            if w.rsplit("/", 1)[-1].startswith(_LAUNCHERS):
                return argv[i:]
    return argv


def harmless(argv: list[str]) -> bool:
    """A command that changes nothing aceso reads (``echo``, ``mkdir``, ``set -e``, ...)."""
    return bool(argv) and argv[0].rsplit("/", 1)[-1] in _HARMLESS


def _script_run(argv: list[str]) -> str | None:
    """The script a runner runs: a ``*.sh`` word, or the word after a nested ``bash`` / ``sh`` (``srun ... bash
    $1``), shown as the file wrote it (``$1``)."""
    for i, w in enumerate(argv[1:], start=1):
        if w.endswith((".sh", ".bash", ".sbatch", ".slurm")) or (
                i > 1 and argv[i - 1].rsplit("/", 1)[-1] in ("bash", "sh") and w != "-c"):
            return re.sub(r"<unset:([^>]*)>", r"$\1", w)
    return None


def _module(argv: list[str]) -> str | None:
    """The module a launcher runs with ``-m MODULE`` / ``--module MODULE`` (after a launcher module such as
    ``python -m torch.distributed.run ... -m MODULE``, the one it launches)."""
    found = None
    for i, w in enumerate(argv[1:-1], start=1):
        if w in ("-m", "--module"):
            found = argv[i + 1]
        elif w.startswith("-m") and len(w) > 2 and not w.startswith("--"):
            found = w[2:]
        if found is not None and found not in _LAUNCH_MODULES:
            return found
    return found


def script_names(text: str) -> list[str]:
    """Every ``*.py`` path the text names (comments excluded), in order, and every module a launcher runs with
    ``-m`` (``python -m a.b``, ``torchrun ... -m a.b`` as ``a/b.py``, also with the ``-m`` on a continuation line; the
    launcher modules themselves left out)."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():      # a command continued over lines is one line
        line = re.sub(r"(^|\s)#.*$", "", line)
        found = [(m.start(), m.group()) for m in re.finditer(r"[\w./${}-]*\.py\b", line)]
        if re.search(r"(^|[\s/\"'=])(python3?|torchrun|deepspeed)\b", line):
            found += [(m.start(1), m.group(1).replace(".", "/") + ".py")
                      for m in re.finditer(r"(?:^|\s)(?:-u?m|--module)\s+([\w.${}]+)", line)
                      if m.group(1) not in _LAUNCH_MODULES]
        out += [name for _, name in sorted(found)]
    return out


def check_unreadable(text: str, source: str, err: AcesoError):
    """A script aceso cannot read: refuse it for what it runs when that is not an entry point aceso reads (the
    priced ones and the hybrid-pattern ones); else the reading failure."""
    names = script_names(text)
    if names and not any(n.rsplit("/", 1)[-1] in READ for n in names):
        refuse_entry(names[-1], source)
    raise err
