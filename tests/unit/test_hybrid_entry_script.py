"""A ``pretrain_hybrid.py`` launch script aceso cannot read (Megatron-LM core_v0.18.2 / core_v0.19.0's own
``examples/mamba/train.sh`` picks its model with a ``case`` statement) is refused for how it is written, like a
``pretrain_gpt.py`` one: "a 'case' statement ...: write the command out". Before, it was refused for what it runs,
"a hybrid Mamba model, which aceso does not price", though aceso prices ``pretrain_hybrid.py`` runs
(docs/megatron.md, "Hybrid Mamba models"): the same script written out imports as the hybrid model."""

from search.cli import main

# Megatron-LM core_v0.19.0 examples/mamba/train.sh, shortened (its 800M model, fewer training flags)
SCRIPT = """#!/bin/bash
MODEL_SCALE="800M"
{choice}
options=" \\
       --tensor-model-parallel-size ${{TENSOR_MODEL_PARALLEL_SIZE}} --sequence-parallel \\
       --pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce \\
       --untie-embeddings-and-output-weights --init-method-std 0.02 --position-embedding-type none \\
       --hybrid-layer-pattern ${{HYBRID_LAYER_PATTERN}} --hidden-size ${{HIDDEN_SIZE}} \\
       --num-attention-heads ${{NUM_ATTENTION_HEADS}} --group-query-attention --num-query-groups 8 \\
       --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 4 --global-batch-size 32 \\
       --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear --normalization RMSNorm --bf16 \\
       --tokenizer-type NullTokenizer --vocab-size 32000 \\
       --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec"
torchrun --nproc_per_node 8 ../../pretrain_hybrid.py ${{options}}
"""
SIZES = """TENSOR_MODEL_PARALLEL_SIZE=1
        HYBRID_LAYER_PATTERN="M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-"
        HIDDEN_SIZE=1024
        NUM_ATTENTION_HEADS=16"""
CASE = f"""case "${{MODEL_SCALE}}" in
    "800M")
        {SIZES}
        ;;
esac"""


def _import(tmp_path, choice: str) -> tuple[int, str]:
    src, out = tmp_path / "train.sh", tmp_path / "plan.json"
    src.write_text(SCRIPT.format(choice=choice))
    rc = main(["import", str(src), "--from", "megatron-lm", "--cluster", "1x8-h100", "-o", str(out)])
    assert out.exists() == (rc == 0)
    return rc, out.read_text() if rc == 0 else ""


def test_an_unreadable_hybrid_script_is_refused_for_how_it_is_written(tmp_path, capsys):
    rc, _ = _import(tmp_path, CASE)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "a 'case' statement" in err and "write the command out" in err and "does not price" not in err, err


def test_the_same_script_written_out_is_the_hybrid_model(tmp_path, capsys):
    rc, plan = _import(tmp_path, SIZES)
    assert rc == 0, capsys.readouterr().err
    assert '"hybrid_layer_pattern": "M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-"' in plan


# Megatron-LM's data step (tools/preprocess_data.py, its README's "Data Preprocessing") in the same launch script
PREPROCESS = ("python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus "
              "--tokenizer-type NullTokenizer --vocab-size 32000 --workers 8\n")


def test_a_data_step_beside_the_hybrid_run_is_not_its_run(tmp_path, capsys):
    """A script that prepares its data with ``tools/preprocess_data.py`` and then runs ``pretrain_hybrid.py`` prices
    the ``pretrain_hybrid.py`` run, as a ``pretrain_gpt.py`` script with a data step prices that one: the plan is
    the one of the same script without the data step. Before, only pretrain_gpt.py / pretrain_t5.py runs were told
    apart from the other Python commands, so it was refused: "runs pretrain_hybrid.py 2 times with different
    arguments", though one of them runs preprocess_data.py."""
    rc, alone = _import(tmp_path, SIZES)
    assert rc == 0, capsys.readouterr().err
    src, out = tmp_path / "prep.sh", tmp_path / "prep.json"
    src.write_text(SCRIPT.format(choice=SIZES).replace("torchrun", PREPROCESS + "torchrun"))
    rc = main(["import", str(src), "--from", "megatron-lm", "--cluster", "1x8-h100", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert out.read_text() == alone


def test_a_refusal_names_the_hybrid_entry_point_as_a_fix(tmp_path, capsys):
    """A file that runs no entry point aceso reads (a wrapper around another script, another program) is refused
    with the scripts to give instead; pretrain_hybrid.py is one (Megatron-LM core_v0.19.0's examples/mamba/train.sh
    runs it, and its script imports: test above). Before, the fix named pretrain_gpt.py or pretrain_t5.py only, so
    a Nemotron-H user was told to give a GPT script."""
    for text in ("set -e\nbash ./train_hybrid.sh\n", "mkdir -p out\nmy_trainer --layers 4\n", "A=1\n",
                 "python foo.py --layers 4\n"):
        src = tmp_path / "wrap.sh"
        src.write_text(text)
        rc = main(["import", str(src), "--from", "megatron-lm", "--cluster", "1x8-h100", "-o",
                   str(tmp_path / "p.json")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "pretrain_hybrid.py" in err, err
