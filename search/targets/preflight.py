"""One pre-flight: will the target run this plan? (issue 25: "what validate accepts, the runtime runs").

``preflight(plan, device, target=...)`` is the one answer, asked by ``aceso validate``, by the search before it
writes a plan (it emits only plans its target runs) and by ``aceso launch`` / ``aceso train`` before any process
exists (target ``runtime``: the aceso runtime runs whatever plan it is given). It is one ``AcesoError`` line naming
the stage or field, or None. Two parts, one function:

- the capability table (``search/targets/capabilities.py``, torch-free, so it always applies): the target's rules for the
  model, the plan and the device (``cpu``: no CUDA, no transformer-engine; ``cuda``: its software unknown unless
  ``here``). For the runtime that is what it does not run (low-precision recipes, GPT-OSS's softmax offset, MoE
  expert bias, activation offload, Megatron FSDP beyond one dense or tp-1 stage, expert tp > 1 with the alltoall
  dispatcher on CPU, ...), for Megatron-LM / Bridge their one shape; for every target megatron-core's own rules
  (the padded vocabulary per tp, bf16 first / last layers, context parallelism needs transformer-engine);
- for the runtime target only, the runtime's checks that need torch, reached through the ``aceso.subcommands``
  entry point of ``train`` (a module attribute ``preflight(plan, device)``), so that this package never names the
  runtime: the layer specs (importable, transformer-engine where there is none, carvable or kept whole in one chunk
  with one recompute none/full), the ``megatron`` block against the installed ``TransformerConfig`` (names and
  types), and, for a run on this machine (``here=True``: ``launch --cpu``, train), the machine's environment. They
  run only for what they can refuse: a plan whose model has a ``layer_spec``, a ``megatron`` block or MoE / MLA /
  MTP, a Megatron FSDP plan, a hybrid model's plan for a CPU cluster (it runs on this machine's megatron-core,
  which runs hybrid models from 0.19: ``hybrid_refusal``), or a run here. Without the runtime installed they are skipped, and
  ``runtime_checked`` says so; the table's rules are not.
"""

from __future__ import annotations

from search.targets.capabilities import RUNTIME, Device, plan_refusal, plan_target, target_key
from search.io.errors import AcesoError
from search.targets.runtime_rules import RUNTIME_LOW_PRECISION  # noqa: F401  (re-exported: the search's refusal names it)

RUNTIME_PACKAGES = ("torch", "megatron")   # what the runtime needs installed beyond the planner
RUNTIME_ENTRY = "train"      # the aceso.subcommands entry point whose module carries ``preflight``


def preflight(plan, device: str | None = None, here: bool = False, target: str | None = None) -> bool:
    """Refuse (``AcesoError``) what ``target`` (default: the plan's own, its ``settings.framework``) would not run on
    ``device`` (default: the plan's cluster's); returns whether the runtime's torch checks ran (True where they
    have nothing to check)."""
    device = device or target_device(plan)
    key = target_key(target) if target is not None else plan_target(plan)
    planner_checks(plan, device, key)
    if key != RUNTIME:
        return True          # Megatron-LM / Bridge: the table is all there is to ask
    m = plan.model
    hybrid_here = m.hybrid_layer_pattern is not None and device == "cpu"   # a CPU plan runs this megatron-core
    if not (here or hybrid_here or m.layer_spec or m.megatron or m.moe or m.mla or m.mtp_num_layers
            or plan.megatron_fsdp):
        return True          # nothing the runtime checks beyond the table
    check = runtime_preflight()
    if check is None:
        return False
    try:
        return check(plan, device, here=here) is not False
    except ModuleNotFoundError as e:     # the runtime's package is here but torch or megatron-core is not
        if here or (e.name or "").split(".")[0] not in RUNTIME_PACKAGES:
            raise
        return False


def target_device(plan) -> str:
    """The device a plan is made for: cpu for a ``*-cpu`` cluster, else cuda."""
    return "cpu" if plan.cluster is not None and plan.cluster.gpu.name == "cpu" else "cuda"


def planner_checks(plan, device: str, target: str | None = None) -> None:
    """The capability table's verdict for ``target`` (default: the plan's own) on ``device``, as an ``AcesoError``."""
    why = plan_refusal(plan, target, Device.of(device))
    if why is not None:
        raise AcesoError(why)


def runtime_preflight():
    """The runtime's ``preflight(plan, device, here)``, or None in a planner-only install."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="aceso.subcommands"):
        if ep.name != RUNTIME_ENTRY:
            continue
        try:
            return getattr(ep.load(), "preflight", None)
        except ModuleNotFoundError:
            return None
    return None
