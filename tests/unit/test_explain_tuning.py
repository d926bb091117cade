"""`aceso explain --megatron-args` keeps a script's DP / pipeline tuning and HybridEP's SM count in its searches.

Explain priced "your configuration" with the script's --ddp-bucket-size, --ddp-num-buckets, --no-align-grad-reduce,
--no-overlap-p2p-communication and --moe-hybridep-num-sms, but its drop-in and heterogeneous searches ran under the
defaults: the comparison mixed settings and the printed command / --save-best plans lost the tuning. Now the printed
`aceso search` command carries them (Megatron-LM's own flags), every searched plan keeps what the import read from
the script (the reference: `read_megatron` of the same line), each line is priced with it (`plan_price.price` of
the saved plan, which differs from the plan priced without it), and the command writes byte for byte the plan
--save-best wrote."""

import json
import shlex

import pytest

from search.cli import main
from search.megatron.importer import read_megatron
from search.pricing.plan_price import price
from search.spec.cluster import parse_cluster
from search.spec.plan import load_plan

DENSE = ("--num-layers 2 --hidden-size 1024 --ffn-hidden-size 3584 --num-attention-heads 16 --group-query-attention "
         "--num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope "
         "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
         "--micro-batch-size 1 --global-batch-size 64 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
         "--use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 32000 --overlap-grad-reduce ")
MOE = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 "
       "--micro-batch-size 1 --global-batch-size 64 --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 "
       "--position-embedding-type rope --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 "
       "--expert-model-parallel-size 8 --moe-grouped-gemm --moe-token-dispatcher-type flex "
       "--moe-flex-dispatcher-backend hybridep --moe-pad-expert-input-to-capacity --moe-expert-capacity-factor 1.0 ")


def _explain(line: str, cluster: str, best, capsys, budget: int = 40) -> dict:
    assert main(["explain", "--megatron-args", line, "--cluster", cluster, "--search-budget-evals", str(budget),
                 "--save-best", str(best), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["megatron_search"]


def _reproduced(command: str, saved, out, capsys) -> None:
    """The printed command, run, writes byte for byte the plan --save-best wrote."""
    assert main(shlex.split(command)[1:] + ["-o", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert out.read_bytes() == saved.read_bytes()


def _without(plan, **update):
    """The plan with these settings fields replaced (what it would be had the search dropped the tuning)."""
    return plan.model_copy(update={"settings": plan.settings.model_copy(update=update)})


def test_the_searched_plans_keep_the_scripts_bucket_size_and_alignment(tmp_path, capsys):
    line = DENSE + "--ddp-bucket-size 12345678 --no-align-grad-reduce"
    own = read_megatron(line, cluster=parse_cluster("1x8-h100")).plan.settings.data_parallel
    assert (own.bucket_size, own.align_grad_reduce) == (12345678, False)       # (the reference: the import's)
    best = tmp_path / "best.json"
    g = _explain(line, "1x8-h100", best, capsys)
    saved = {"megatron": best, "aceso": tmp_path / "best.aceso.json"}
    for key in ("megatron", "aceso"):
        assert "--ddp-bucket-size 12345678 --no-align-grad-reduce" in g[key]["command"]
        plan = load_plan(str(saved[key]))
        assert plan.settings.data_parallel == own
        assert g[key]["iteration_ms"] == pytest.approx(price(plan).iteration_ms, rel=1e-9)
        if plan.settings.overlap_grad_reduce and plan.stages[0].dp > 1:      # the bucket size is priced
            assert price(_without(plan, data_parallel=None)).iteration_ms != pytest.approx(g[key]["iteration_ms"])
        _reproduced(g[key]["command"], saved[key], tmp_path / f"{key}.json", capsys)


def test_a_bucket_count_is_kept_by_the_drop_in_plan_and_the_runtime_line_says_why_it_is_not_offered(tmp_path,
                                                                                                      capsys):
    """--ddp-num-buckets: Megatron-LM sizes each rank's buckets from its parameter count; the aceso runtime's DDP
    config takes a bucket size only (runtime_rules.data_parallel), so the heterogeneous line is not offered, and
    `aceso search --target aceso --ddp-num-buckets` is refused in one line before any search."""
    best = tmp_path / "best.json"
    g = _explain(DENSE + "--ddp-num-buckets 3", "1x8-h100", best, capsys)
    assert "--ddp-num-buckets 3 --target megatron-lm" in g["megatron"]["command"]
    assert load_plan(str(best)).settings.data_parallel.num_buckets == 3
    _reproduced(g["megatron"]["command"], best, tmp_path / "m.json", capsys)
    assert "--ddp-num-buckets: the aceso runtime sizes DDP buckets by bucket_size only" in g["aceso"]["not_offered"]
    assert main(shlex.split(g["aceso"]["command"])[1:] + ["-o", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ddp-num-buckets with --target aceso" in err
    assert not (tmp_path / "a.json").exists()


PP = ("--num-layers 8 --hidden-size 1024 --ffn-hidden-size 3584 --num-attention-heads 16 --seq-length 2048 "
      "--max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm --swiglu "
      "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 64 --bf16 "
      "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --tokenizer-type NullTokenizer "
      "--vocab-size 32000 --no-overlap-p2p-communication")


def test_synchronous_p2p_is_kept_and_megatron_lms_pp_above_2_rule_holds_in_the_search(tmp_path, capsys):
    """--no-overlap-p2p-communication (settings.overlap_p2p_comm False) travels in the command and the plans;
    Megatron-LM's validate_args asserts pp > 2 for the interleaved schedule without p2p overlap (core_v0.16.1
    arguments.py:573-590, core_v0.19.0 :966-985), so a Megatron-LM search under it never returns virtual stages on
    pp 2, refuses a space that holds only those, and the export refuses such a plan."""
    assert read_megatron(PP, cluster=parse_cluster("1x8-h100")).plan.settings.overlap_p2p_comm is False
    best = tmp_path / "best.json"
    g = _explain(PP, "1x8-h100", best, capsys)
    for key, saved in (("megatron", best), ("aceso", tmp_path / "best.aceso.json")):
        assert "--no-overlap-p2p-communication" in g[key]["command"]
        assert load_plan(str(saved)).settings.overlap_p2p_comm is False
        _reproduced(g[key]["command"], saved, tmp_path / f"{key}.json", capsys)
    model = str(tmp_path / "best.model.json")
    common = ["search", "--model", model, "--cluster", "1x8-h100", "--global-batch-size", "64",
              "--no-overlap-p2p-communication", "--target", "megatron-lm", "--budget-evals", "60"]
    out = tmp_path / "pp.json"
    assert main(common + ["--pp", "2", "4", "--vpp", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(str(out))
    assert (plan.num_stages, plan.num_virtual_stages, plan.settings.overlap_p2p_comm) == (4, 2, False)
    # priced synchronous: the same plan with the overlap prices otherwise
    assert price(_without(plan, overlap_p2p_comm=None)).iteration_ms != pytest.approx(price(plan).iteration_ms)
    assert main(common + ["--pp", "2", "--vpp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than 2 pipeline stages only" in err
    from search.megatron import check_expressible
    from search.spec.plan import ParallelPlan
    assert main(["search", "--model", model, "--cluster", "1x8-h100", "--global-batch-size", "64", "--target",
                 "megatron-lm", "--pp", "2", "--vpp", "2", "--budget-evals", "20", "-o", str(out)]) == 0
    capsys.readouterr()
    two = load_plan(str(out))
    assert check_expressible(two) is None
    sync = ParallelPlan.model_validate({**json.loads(out.read_text()),
                                        "settings": {**json.loads(out.read_text())["settings"],
                                                     "overlap_p2p_comm": False}})
    assert "asserts pp > 2" in check_expressible(sync)


def test_the_runtimes_synchronous_p2p_does_not_impose_megatron_lms_pp_above_2_rule(tmp_path, capsys):
    """Megatron-LM's pp > 2 rule is for plans that say --no-overlap-p2p-communication. A search for the runtime
    prices its own interleaved p2p synchronous, but its Megatron-LM lines run Megatron-LM's overlapped default:
    --pp 2 --vpp 2 searches (before, it was refused naming a flag the command did not give)."""
    out = tmp_path / "p.json"
    assert main(["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--pp", "2",
                 "--vpp", "2", "--budget-evals", "40", "--workers", "1", "-o", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    plan = load_plan(str(out))
    assert (plan.num_stages, plan.num_virtual_stages, plan.settings.overlap_p2p_comm) == (2, 2, None)


def test_the_searched_plans_keep_the_scripts_hybridep_sm_count(tmp_path, capsys):
    """--moe-hybridep-num-sms 16 (HybridEP priced at its published 16-SM rate; the newest release's default is
    HybridEP's own 32): the drop-in plan, a flex plan on HybridEP, keeps 16 SMs and is priced at them."""
    line = MOE + "--moe-hybridep-num-sms 16"
    own = read_megatron(line, cluster=parse_cluster("1x8-b200")).plan.settings.moe
    assert (own.flex_backend, own.hybridep_num_sms) == ("hybridep", 16)
    best = tmp_path / "best.json"
    g = _explain(line, "1x8-b200", best, capsys)
    assert "--moe-hybridep-num-sms 16" in g["megatron"]["command"]
    plan = load_plan(str(best))
    assert (plan.settings.moe.flex_backend, plan.settings.moe.hybridep_num_sms) == ("hybridep", 16)
    assert g["megatron"]["iteration_ms"] == pytest.approx(price(plan).iteration_ms, rel=1e-9)
    at32 = _without(plan, moe=plan.settings.moe.model_copy(update={"hybridep_num_sms": 32}))
    assert price(at32).iteration_ms < g["megatron"]["iteration_ms"]        # 32 SMs: HybridEP's faster rate
    _reproduced(g["megatron"]["command"], best, tmp_path / "m.json", capsys)


def test_hybridep_sms_stay_on_the_hybridep_candidates_and_a_dense_model_refuses_them(tmp_path, capsys):
    """megatron-core sizes only HybridEP's kernels with the SM count (moe_plan.settings_refusal): of the final
    step's dispatcher candidates, only flex on HybridEP carries it."""
    from search.planner.dispatchers import candidates
    from search.settings.moe_plan import settings_refusal
    imp = read_megatron(MOE + "--moe-hybridep-num-sms 32", cluster=parse_cluster("1x8-b200"))
    model = imp.plan.model.model_copy(update={"moe": imp.plan.model.moe.model_copy(
        update={"moe_pad_expert_input_to_capacity": False})})       # (flex on DeepEP a candidate too)
    from search.settings.moe_plan import MoEPlanSettings
    cands = candidates(model, parse_cluster("1x8-b200"), MoEPlanSettings(), sms=32)
    sms = {(c.token_dispatcher, c.flex_backend): c.hybridep_num_sms for c in cands}
    assert sms == {("alltoall", "deepep"): None, ("allgather", "deepep"): None, ("flex", "deepep"): None,
                   ("flex", "hybridep"): 32}
    assert all(settings_refusal(c, model) is None for c in cands)
    # given the SM count, the search runs flex on HybridEP, the backend the count is for (the script's, as read)
    from search.planner.space import Space
    from search.spec.training import TrainingSpec
    assert imp.plan.settings.moe.flex_backend == "hybridep"
    for sms, backend in ((32, "hybridep"), (None, "deepep")):
        training = TrainingSpec(global_batch_size=64, token_dispatchers=["flex", "alltoall"], moe_hybridep_num_sms=sms)
        space = Space.of(model, parse_cluster("1x8-b200"), training)
        assert (space.moe.token_dispatcher, space.moe.flex_backend, space.moe.hybridep_num_sms) == ("flex", backend,
                                                                                                     sms)
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "2", "--cluster", "1x8-h100", "--global-batch-size",
                 "16", "--moe-hybridep-num-sms", "16", "--budget-evals", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--moe-hybridep-num-sms: gpt-1.3b is a dense model" in err
