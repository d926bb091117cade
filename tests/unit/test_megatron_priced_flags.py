"""Megatron-LM flags the import used to list as unpriced and now prices (helper audit, /work/notes flag audit):
``--no-overlap-p2p-communication`` (``settings.overlap_p2p_comm``), ``--ddp-num-buckets`` (``settings.data_parallel.
num_buckets``), ``--squared-relu`` on a GPT line (``model.activation``), ``--moe-hybridep-num-sms``
(``settings.moe.hybridep_num_sms``). Each: read (not in the warning), megatron-core's asserts as one-line refusals
(exit 2, nothing written), priced against a hand-computed reference, written back by the Megatron-LM export."""

import pytest

from search.cli import main
from search.megatron.importer import read_megatron
from search.megatron.names import megatron_lm_args
from search.pricing.plan_price import price
from search.spec.cluster import parse_cluster

GPT = ("--num-layers 16 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
       "--micro-batch-size 1 --global-batch-size 64 --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 ")
VPP = "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "


def _refused(tmp_path, capsys, line: str, world: int = 8) -> str:
    f = tmp_path / "args.txt"
    f.write_text(line)
    assert main(["import", str(f), "--from", "megatron-lm", "--world-size", str(world), "-o",
                 str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "p.json").exists()
    return err


def _flat(c) -> str:
    return " ".join(x for part in megatron_lm_args(c).values() for x in part)


# ----- 1. --no-overlap-p2p-communication ---------------------------------------------------------------------------
def test_no_overlap_p2p_is_read_and_exposes_all_p2p():
    """megatron-core with overlap_p2p_comm off sends the interleaved schedule's p2p synchronously and batched
    (batch_p2p_comm = not overlap_p2p_comm, training/argument_utils.py:307): none of it hides behind a chunk. The
    same p2p volume (exposed + hidden with the overlap) is all exposed without it."""
    cl = parse_cluster("2x4-h100")
    on = read_megatron(GPT + VPP, cluster=cl)
    off = read_megatron(GPT + VPP + "--no-overlap-p2p-communication", cluster=cl)
    assert on.plan.settings.overlap_p2p_comm is None and off.plan.settings.overlap_p2p_comm is False
    assert off.ignored == [] and off.warning is None
    a, b = price(on.plan), price(off.plan)
    for sa, sb in zip(a.stages, b.stages):
        exposed, hidden = sa.comm["p2p"]
        assert hidden > 0
        assert sb.comm["p2p"] == pytest.approx((exposed + hidden, 0.0))
    assert b.iteration_ms > a.iteration_ms
    # the export writes it back; without virtual stages Megatron-LM turns the overlap off anyway: nothing priced
    assert "--no-overlap-p2p-communication" in _flat(off.config)
    assert "--no-overlap-p2p-communication" not in _flat(on.config)
    plain = read_megatron(GPT + "--pipeline-model-parallel-size 4 --no-overlap-p2p-communication", world_size=8)
    assert plain.plan.settings.overlap_p2p_comm is None and plain.ignored == []
    assert "overlap_p2p_comm" not in on.plan.model_dump_json()      # digests of plans without it unchanged


def test_the_runtime_prices_interleaved_p2p_synchronous_and_refuses_the_overlap():
    """The aceso runtime's pipeline communicator runs the interleaved schedule's sends / receives synchronously (its
    interleaved calls refuse megatron-core's overlap_p2p_comm): a runtime plan with the field unset is priced as
    Megatron-LM's --no-overlap-p2p-communication, all p2p exposed (before: as Megatron-LM's overlapped default);
    the field set true is refused by the runtime's pre-flight in one line."""
    from search.targets.capabilities import Device, plan_refusal
    cl = parse_cluster("2x4-h100")
    mlm = read_megatron(GPT + VPP, cluster=cl).plan
    runtime = mlm.model_copy(update={"settings": mlm.settings.model_copy(update={"framework": "runtime"})})
    sync = read_megatron(GPT + VPP + "--no-overlap-p2p-communication", cluster=cl).plan
    a, b, c = price(mlm), price(runtime), price(sync)
    for sa, sb, sc in zip(a.stages, b.stages, c.stages):
        assert sa.comm["p2p"][1] > 0 and sb.comm["p2p"][1] == 0.0
        assert sb.comm["p2p"] == pytest.approx(sc.comm["p2p"])
    on = runtime.model_copy(update={"settings": runtime.settings.model_copy(update={"overlap_p2p_comm": True})})
    assert plan_refusal(runtime, "aceso", Device(cuda=True, te=True)) is None
    why = plan_refusal(on, "aceso", Device(cuda=True, te=True))
    assert why is not None and why.startswith("settings.overlap_p2p_comm:"), why


def test_no_overlap_p2p_with_pp_2_is_megatrons_assert(tmp_path, capsys):
    """validate_args (core_v0.19.0 arguments.py:971-975): interleaved without p2p overlap needs pp > 2."""
    err = _refused(tmp_path, capsys, GPT + "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                   "--no-overlap-p2p-communication")
    assert "--no-overlap-p2p-communication" in err and "pp > 2" in err


# ----- 2. --ddp-num-buckets ----------------------------------------------------------------------------------------
DP = "--use-distributed-optimizer --overlap-grad-reduce "
H = 4096
# the rank's parameters on one stage (tp 1): 16 layers of 12h^2 + 13h (QKV + projection with biases 4h^2 + 4h, GeLU MLP
# 8h^2 + 5h, two layernorms 4h), word embeddings 32000 h (tied), learned positions 4096 h, final layernorm 2h
RANK_PARAMS = 16 * (12 * H * H + 13 * H) + 32000 * H + 4096 * H + 2 * H


def test_ddp_num_buckets_is_the_ranks_parameters_over_n():
    """Megatron-LM (core_v0.19.0 training.py:1559-1560 resolve_ddp_bucket_size; core_v0.16.1 training.py:1303):
    bucket_size = num_parameters // num_buckets, num_parameters the rank's own. Priced exactly as that
    --ddp-bucket-size, and not as one parameter more per bucket (10 buckets instead of 11)."""
    cl = parse_cluster("2x8-h100")
    n = read_megatron(GPT + DP + "--ddp-num-buckets 10", cluster=cl)
    assert n.plan.settings.data_parallel.num_buckets == 10 and n.ignored == [] and n.warning is None
    same = read_megatron(GPT + DP + f"--ddp-bucket-size {RANK_PARAMS // 10}", cluster=cl)
    other = read_megatron(GPT + DP + f"--ddp-bucket-size {RANK_PARAMS // 10 + 1}", cluster=cl)
    default = read_megatron(GPT + DP, cluster=cl)
    pn, ps, po, pd = (price(x.plan) for x in (n, same, other, default))
    assert pn.stages[0].dp_sync_ms == ps.stages[0].dp_sync_ms and pn.iteration_ms == ps.iteration_ms
    assert pn.stages[0].dp_sync_ms != po.stages[0].dp_sync_ms
    assert pn.iteration_ms != pd.iteration_ms
    assert "--ddp-num-buckets 10" in _flat(n.config)
    # without --overlap-grad-reduce megatron-core uses no buckets (bucket_size None): nothing to price
    assert read_megatron(GPT + "--ddp-num-buckets 10", world_size=8).plan.settings.data_parallel is None


@pytest.mark.parametrize("extra, needle", [
    ("--ddp-num-buckets 0", "must be greater than 0"),
    ("--ddp-num-buckets 4 --ddp-bucket-size 1000000", "Cannot specify both"),
])
def test_ddp_num_buckets_asserts(extra, needle, tmp_path, capsys):
    assert needle in _refused(tmp_path, capsys, GPT + DP + extra)


def test_ddp_num_buckets_has_no_bridge_field_and_the_runtime_refuses_it():
    from search.io.errors import AcesoError
    from search.megatron.names import bridge_fields
    from search.targets.capabilities import plan_refusal
    imp = read_megatron(GPT + DP + "--ddp-num-buckets 10", world_size=8)
    with pytest.raises(AcesoError, match="num_buckets"):
        bridge_fields(imp.config)
    why = plan_refusal(imp.plan, "aceso")
    assert why is not None and why.startswith("settings.data_parallel.num_buckets") and "\n" not in why
    assert plan_refusal(imp.plan, "megatron-lm") is None


# ----- 3. --squared-relu on a GPT line -----------------------------------------------------------------------------
def test_squared_relu_on_a_gpt_line_is_the_models_activation():
    """megatron-core's squared_relu (activation_func; no gated linear unit): the MLP GEMMs of GeLU (fc1 h x 4h, fc2
    4h x h), so the price is GeLU's; the model says it and the export writes it back."""
    cl = parse_cluster("1x8-h100")
    gelu = read_megatron(GPT, cluster=cl)
    sq = read_megatron(GPT + "--squared-relu", cluster=cl)
    assert gelu.plan.model.activation == "gelu" and sq.plan.model.activation == "squared_relu"
    assert sq.ignored == [] and sq.warning is None
    assert price(sq.plan).iteration_ms == price(gelu.plan).iteration_ms
    assert "--squared-relu" in _flat(sq.config).split()


def test_squared_relu_with_swiglu_is_megatrons_assert(tmp_path, capsys):
    """core_v0.19.0 training/argument_utils.py:320-321 (core_v0.16.1 arguments.py:1338-1339): assert not swiglu."""
    err = _refused(tmp_path, capsys, GPT + "--squared-relu --swiglu")
    assert "--squared-relu and --swiglu" in err


# ----- 4. --moe-hybridep-num-sms / --moe-flex-dispatcher-num-sms ---------------------------------------------------
MOE = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 "
       "--micro-batch-size 1 --global-batch-size 64 --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 "
       "--position-embedding-type rope --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 "
       "--expert-model-parallel-size 8 --moe-grouped-gemm --moe-token-dispatcher-type flex ")
HYBRIDEP = MOE + "--moe-flex-dispatcher-backend hybridep "


def _ep_ms(line: str, version: str) -> tuple[float, int | None]:
    imp = read_megatron(line, cluster=parse_cluster("1x8-b200"), version=version)
    assert imp.ignored == [] and imp.warning is None, imp.ignored
    return price(imp.plan).stages[0].ep_comm_ms, imp.plan.settings.moe.hybridep_num_sms


def test_hybridep_sms_price_the_published_rates_and_the_release_default():
    """The release's default SM count (core_v0.16.1 TransformerConfig moe_hybridep_num_sms = 16; core_v0.19.0
    moe_flex_dispatcher_num_sms None: HybridEP's own 32) priced as its calibration does; 16 and 32 given at
    HybridEP's GB200 NVL72 rates (0.49 and 0.53 of NVLink: the exchange about 0.53 / 0.49 longer at 16)."""
    d16, none16 = _ep_ms(HYBRIDEP, "0.16")
    d32, none32 = _ep_ms(HYBRIDEP, "0.19")
    assert none16 is None and none32 is None                     # not given: nothing stored, priced as before
    g16, s16 = _ep_ms(HYBRIDEP + "--moe-hybridep-num-sms 16", "0.19")
    g32, s32 = _ep_ms(HYBRIDEP + "--moe-flex-dispatcher-num-sms 32", "0.19")
    o32, _ = _ep_ms(HYBRIDEP + "--moe-hybridep-num-sms 32", "0.16")
    dep, sdep = _ep_ms(HYBRIDEP + "--moe-deepep-num-sms 16", "0.19")     # 0.19 routes it to HybridEP
    assert (s16, s32, sdep) == (16, 32, 16)
    assert g16 == pytest.approx(d16) and g32 == pytest.approx(d32) and o32 == pytest.approx(d32)
    assert dep == pytest.approx(g16)
    assert g16 / g32 == pytest.approx(0.53 / 0.49, rel=0.01)
    imp = read_megatron(HYBRIDEP + "--moe-hybridep-num-sms 32", world_size=8, version="0.16")
    assert "--moe-hybridep-num-sms 32" in _flat(imp.config)
    from search.megatron.names import bridge_fields
    assert bridge_fields(imp.config)["model"]["moe_hybridep_num_sms"] == 32


@pytest.mark.parametrize("extra, needle", [
    ("--moe-flex-dispatcher-backend hybridep --moe-hybridep-num-sms 24", "16 or 32 SMs only"),
    ("--moe-flex-dispatcher-backend hybridep --moe-deepep-num-sms 20 --moe-hybridep-num-sms 32",
     "conflicting SM counts"),
    ("--moe-flex-dispatcher-num-sms 32", "with the deepep backend"),
])
def test_hybridep_sms_refusals(extra, needle, tmp_path, capsys):
    assert needle in _refused(tmp_path, capsys, MOE + extra)


# ----- 5. transformer-engine's TP-overlap method overrides ---------------------------------------------------------
TP4 = GPT + "--tensor-model-parallel-size 4 --sequence-parallel "


@pytest.mark.parametrize("flag, needle", [
    ("--tp-comm-overlap-cfg ub.yaml", "per-GEMM overlap methods"),
    ("--disable-tp-comm-overlap-ag", "ring-exchange"),            # the --disable- spelling: same parser field
    ("--no-tp-comm-overlap-rs", "pipelined overlap"),
    ("--no-tp-comm-bulk-dgrad", "bulk overlap"),
    ("--disable-tp-comm-bulk-wgrad", "bulk overlap"),
    ("--tp-comm-overlap-rs-dgrad", "pipelined with its GEMM"),
])
def test_tp_overlap_method_overrides(flag, needle, tmp_path, capsys):
    """megatron-core's ModelParallelConfig tp_comm_* fields ("Don't care if tp_comm_overlap is False",
    core_v0.19.0 core/model_parallel_config.py:271-312): with --tp-comm-overlap they change the methods tpcomm.py
    prices (refused in one line); without it they do nothing (read, not in the warning, the price unchanged)."""
    err = _refused(tmp_path, capsys, TP4 + "--tp-comm-overlap " + flag)
    assert "with --tp-comm-overlap" in err and needle in err
    quiet = read_megatron(TP4 + flag, cluster=parse_cluster("1x8-h100"))
    assert quiet.ignored == [] and quiet.warning is None
    assert price(quiet.plan).iteration_ms == price(read_megatron(TP4, cluster=parse_cluster("1x8-h100")).plan
                                                   ).iteration_ms


def test_deprecated_split_flags_do_nothing_from_te_1_5():
    """transformer_engine.py:936-946 (core_v0.19.0): from TE 1.5 ub_overlap_ag / _rs come from tp_comm_overlap_ag /
    _rs; tp_comm_split_* are read only before TE 1.5."""
    imp = read_megatron(TP4 + "--tp-comm-overlap --no-tp-comm-split-ag --disable-tp-comm-split-rs", world_size=8)
    assert imp.ignored == [] and imp.plan.settings.tp_comm_overlap


# ----- 6. --mamba-training-ssm-states-dtype fp32 -------------------------------------------------------------------
HYB = ("torchrun --nproc-per-node 8 pretrain_hybrid.py --hybrid-layer-pattern 'M-M-|M*M-' --spec m s "
       "--hidden-size 4096 --num-attention-heads 32 --seq-length 8192 --max-position-embeddings 8192 "
       "--mamba-num-heads 128 --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8 "
       "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64 --tokenizer-type NullTokenizer "
       "--vocab-size 1000 --bf16 --squared-relu ")


def test_fp32_ssm_states_add_their_extra_bytes_to_the_scan_transient():
    """megatron-core 0.19 (core/ssm/mamba_mixer.py:227-229, 752-753): the scan's passed inter-chunk states in fp32
    instead of bf16. One sequence of 8192 tokens in chunks of 128: 64 chunks x 128 heads x 64 x 128 states x (4 - 2)
    bytes = 128 MiB more while a Mamba layer runs (stage 0: its largest transient); nothing kept changes."""
    cl = parse_cluster("1x8-h100")
    a = read_megatron(HYB, cluster=cl, version="0.19")
    b = read_megatron(HYB + "--mamba-training-ssm-states-dtype fp32", cluster=cl, version="0.19")
    assert b.plan.model.mamba.mamba_training_ssm_states_dtype == "fp32" and b.ignored == [] and b.warning is None
    assert "mamba_training_ssm_states_dtype" not in a.plan.model_dump_json()    # digests without it unchanged
    pa, pb = price(a.plan), price(b.plan)
    ma, mb = pa.stages[0].memory_breakdown, pb.stages[0].memory_breakdown
    assert mb["recompute_peak"] - ma["recompute_peak"] == pytest.approx(64 * 128 * 64 * 128 * 2 / 2 ** 20)
    assert {k: v for k, v in ma.items() if k != "recompute_peak"} == \
        {k: v for k, v in mb.items() if k != "recompute_peak"}
    same = read_megatron(HYB + "--mamba-training-ssm-states-dtype bf16", cluster=cl, version="0.19")
    assert price(same.plan).stages[0].memory_breakdown == ma                  # bf16 states: the activation dtype
    # the export writes it back (core_v0.19 only); Bridge's hybrid overrides refuse it
    from search.megatron.hybrid_pattern import mamba_args, model_refusal
    from search.megatron.bridge_hybrid import model_refusal as bridge_refusal
    from search.megatron.versions import release
    assert mamba_args(b.plan.model)[-2:] == ["--mamba-training-ssm-states-dtype", "fp32"]
    assert model_refusal(b.plan.model, release("0.19")) is None
    assert "core_v0.19" in model_refusal(b.plan.model, release("0.18"))
    assert "mamba_training_ssm_states_dtype" in bridge_refusal(b.plan.model)


def test_hiding_a_transfer_never_costs_more_than_exposing_it():
    """The overlap tax is the share of the device's compute a collective takes while hidden: at most all of it. On
    the ``cpu`` preset (8 nominal SMs, NCCL's 16 CTAs) it was 2, so an interleaved plan's overlapped p2p exposed
    twice what the same plan exposes synchronously (57.1 against 54.6 ms for the README's pipe-gpt plan)."""
    from search.costmodel.comm import overlap_tax
    assert overlap_tax("cpu") == 1.0 and overlap_tax("h100") == pytest.approx(16 / 132)
    mlm = read_megatron(GPT.replace("--hidden-size 4096", "--hidden-size 256").replace(
        "--num-attention-heads 32", "--num-attention-heads 4") + VPP + "--transformer-impl local",
        cluster=parse_cluster("2x4-cpu")).plan
    sync = mlm.model_copy(update={"settings": mlm.settings.model_copy(update={"overlap_p2p_comm": False})})
    for a, b in zip(price(mlm).stages, price(sync).stages):
        assert a.comm["p2p"][0] <= b.comm["p2p"][0] + 1e-9
