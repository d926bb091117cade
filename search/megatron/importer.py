"""``read_megatron``: a Megatron-LM launch script or argument line -> the ``ParallelPlan`` it runs, with notes.

The world size comes from the launcher (``torchrun --nproc-per-node N --nnodes M``), aceso's ``--world-size`` or
the cluster, and must agree where several are given. T5 when the script is ``pretrain_t5.py`` or, for a bare
argument line, when it has ``--encoder-num-layers`` or ``--decoder-seq-length``. The flags are read under one
Megatron-LM release (``version``: ``0.19``, ``core_v0.16.1``, ...; None: the newest, ``versions.py``), with its
parser's flags and defaults and its rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from search.spec.cluster import ClusterSpec
from ..costmodel.kernels import has_flash
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan
from .build import plan_from_config
from .cmdline import Flags, config_from_flags, parse_flags
from .config import MegatronConfig
from .entry import PRICED, EntryRefusal, check_unreadable, entry_list, refuse_entry
from .hybrid_pattern import (ENTRIES, FLAG, HYBRID_SWITCH, OLD_FLAG, current_spelling, hybrid_model, read_argv,
                             run_refusal, unit_choices as hybrid_choices, unit_spans)
from .recompute import unit_choices
from .shell import read_command
from .deprecated import current_flags
from .versions import Release, release as megatron_release


@dataclass
class Imported:
    plan: ParallelPlan
    config: MegatronConfig
    notes: list[str] = field(default_factory=list)     # what was assumed or approximated
    ignored: list[str] = field(default_factory=list)   # flags aceso does not price (nor knows to be harmless)
    release: Release = field(default_factory=megatron_release)  # the Megatron-LM release the flags were read under
    flags: Flags | None = None                         # every flag given, priced or not (Flags.get reads any)

    @property
    def warning(self) -> str | None:
        if not self.ignored:
            return None
        n = len(self.ignored)
        return (f"ignored {n} flag{'s' if n > 1 else ''} aceso does not price (the prediction is the run without "
                f"{'them' if n > 1 else 'it'}): {' '.join(self.ignored)}")


# flags of a hybrid line that a GPT / T5 line (pretrain_gpt.py, pretrain_t5.py) cannot honour, refused there in one
# line (Megatron-LM core_v0.19.0): validate_args takes --num-layers from the pattern (training/arguments.py:761-771)
# but pretrain_gpt.py builds GPT layers; --spec replaces the GPT layer spec (gpt_builders.py:32-33)
GPT_LINE_REFUSED = {
    FLAG: "Megatron-LM takes --num-layers from the pattern but builds GPT layers; run pretrain_hybrid.py for a "
          "hybrid model, or drop it",
    "--spec": "a custom layer spec is not modelled (aceso prices megatron-core's GPT layer spec); drop it",
}


def read_megatron(text: str, source: str = "megatron-lm arguments", world_size: int | None = None,
                  cluster: ClusterSpec | None = None, vocab_size: int | None = None,
                  version: str | None = None, release: str | None = None) -> Imported:
    """The plan a Megatron-LM command line runs. ``version``: the Megatron-LM release whose flags and defaults the
    line is read under (None: the newest, ``versions.py``); ``release``: the software release (NeMo container) it
    runs on, whose calibration prices it (its ``settings.release``, ``search/settings/releases.py``; None: the container
    shipping ``version``'s megatron-core, or the newest)."""
    rel = megatron_release(version)
    try:
        cmd = read_command(text, source)
    except EntryRefusal:
        raise
    except AcesoError as e:
        check_unreadable(text, source, e)
    try:
        cmd = dataclasses.replace(cmd, argv=current_flags(current_spelling(cmd.argv, rel)))
    except AcesoError as e:
        raise AcesoError(f"{source}: {e}") from None
    # a GPT model as a hybrid pattern: pretrain_hybrid.py / pretrain_mamba.py, or a bare line with the pattern
    hybrid = cmd.script in ENTRIES or (not cmd.script and any(w.split("=")[0] == FLAG for w in cmd.argv))
    if cmd.script and cmd.script not in PRICED and not hybrid:
        refuse_entry(cmd.path or cmd.script, source)
    names = {w.split("=", 1)[0] for w in cmd.argv}
    if not hybrid and not names & {OLD_FLAG, HYBRID_SWITCH}:     # (a core_v0.16 hybrid line: refused as one)
        for name in (w.split("=", 1)[0] for w in cmd.argv):
            if name in GPT_LINE_REFUSED and rel.has(name):
                raise AcesoError(f"{source}: {name} with {cmd.script or 'a GPT line'}: {GPT_LINE_REFUSED[name]}")
    if not cmd.script and not cmd.argv and not cmd.assigned:
        raise AcesoError(f"{source}: empty (no command, no arguments); give the launch script that runs "
                         f"{entry_list()}, or its arguments")
    if not cmd.script and not cmd.argv and cmd.assigned:
        raise AcesoError(f"{source}: no command: the file only sets variables ({', '.join(sorted(set(cmd.assigned))[:4])}"
                         f"{', ...' if len(set(cmd.assigned)) > 4 else ''}); give the script that runs "
                         f"{entry_list()}")
    try:
        read = read_argv(cmd.argv, rel) if hybrid else None
        flags = parse_flags(read.argv if read else cmd.argv, rel)
        path = flags.get(TE_CONFIG)
    except AcesoError as e:
        raise AcesoError(f"{source}: {e}") from None
    overrides = te_overrides(path, source, text) if path is not None else ()
    sizes = {k: v for k, v in (("the launcher's", cmd.world_size), ("--world-size", world_size),
                               ("the cluster's", cluster.num_gpus if cluster else None)) if v is not None}
    if not sizes:
        raise AcesoError(f"{source}: the world size is not in the command line (no torchrun --nproc-per-node / "
                         "--nnodes); give --world-size N or --cluster")
    if len(set(sizes.values())) > 1:
        raise AcesoError(f"{source}: world sizes disagree: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    script = cmd.script or ""
    t5 = "t5" in script if script else (flags.has("--encoder-num-layers") or flags.has("--decoder-seq-length"))
    notes: list[str] = list(cmd.notes)
    world = next(iter(sizes.values()))
    try:
        if read and world % read.pp:
            raise AcesoError(f"the world size ({world}) is not a multiple of --pipeline-model-parallel-size "
                             f"({read.pp})")
        cfg = config_from_flags(flags, world // read.pp if read else world, t5, notes, vocab_size)
        if read and read.model_fields:       # a hybrid model: its pattern and Mamba-2 mixer
            cfg = dataclasses.replace(cfg, model=hybrid_model(cfg.model, read.model_fields, notes))
    except AcesoError as e:
        raise AcesoError(f"{source}: {e}") from None
    spans = None
    if read:          # the GPT form on one rank, spread over the pattern's pipeline ranks and chunks
        cfg = dataclasses.replace(cfg, pp=read.pp, vpp=len(read.counts) // read.pp, chunk_layers=read.counts)
        spans = unit_spans(cfg.model, read.counts)
    if cluster is not None and cfg.attention == "flash" and not has_flash(cluster.gpu.name):
        raise AcesoError(f"{source}: --transformer-impl transformer_engine (Megatron-LM's default) runs flash "
                         f"attention, which the {cluster.gpu.name} has not (it needs sm80+, an A100 or newer); add "
                         "--transformer-impl local (megatron-core's unfused attention)")
    plan = plan_from_config(cfg, cluster=cluster, source=source, release=release or version, spans=spans,
                            choices=hybrid_choices if read else unit_choices)
    if read and (why := run_refusal(plan, rel)):      # what the release's hybrid model class does not run
        raise AcesoError(f"{source}: {why}")
    if overrides:
        plan, cfg = with_overrides(plan, cfg, overrides, source)
    return Imported(plan, cfg, notes, flags.ignored, rel, flags)


TE_CONFIG = "--te-precision-config-file"


def te_overrides(path: str, source: str, text: str) -> tuple:
    """The per-module overrides of ``--te-precision-config-file PATH`` (``settings/precision_overrides.py``): a
    relative PATH is looked up next to the script (``source`` when it is a file), then in the working directory,
    then as a here-document the script writes (``cat > PATH <<'EOF'``, as ``aceso export`` writes it). Not found,
    unreadable or unsupported: one line."""
    import os
    import re
    from search.settings.precision_overrides import read_file, read_yaml
    base = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
    cands = [path] if os.path.isabs(path) else [p for p in (base and os.path.join(base, path), path) if p]
    found = next((c for c in cands if os.path.isfile(c)), None)
    here = re.search(r"^cat > " + re.escape(path) + r" <<'(\w+)'\n(.*?)^\1$", text, re.M | re.S)
    if found is None and not here:
        raise AcesoError(f"{source}: {TE_CONFIG} {path}: no such file next to the script or in the working "
                         "directory; give its path")
    try:
        return read_file(found) if found is not None else read_yaml(here.group(2))
    except ValueError as e:
        raise AcesoError(f"{source}: {str(e).splitlines()[0]}") from None


def with_overrides(plan, cfg, overrides: tuple, source: str):
    """``plan`` and ``cfg`` with the per-module overrides on their low-precision recipe; without a recipe: one line
    (megatron-core applies the overrides to quantized layers only)."""
    low = plan.settings.low_precision
    if low is None:
        raise AcesoError(f"{source}: {TE_CONFIG} without --fp8-format / --fp4-format: megatron-core applies the "
                         "overrides to quantized layers only (override_nonquantized_autocast is not priced); give "
                         "the recipe or drop the file")
    settings = plan.settings.model_copy(update={"low_precision": low.model_copy(update={"per_module": overrides})})
    cfg = dataclasses.replace(cfg, settings=settings) if hasattr(cfg, "settings") else cfg
    return plan.model_copy(update={"settings": settings}), cfg
