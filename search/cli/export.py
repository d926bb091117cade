"""Write a plan for another trainer: `aceso export PLAN [--to megatron-lm|megatron-bridge|aceso-legacy] [-o FILE]`.

megatron-lm (the default): a runnable bash script (torchrun + pretrain_gpt.py / pretrain_t5.py with every model,
parallel, recompute, batch and precision argument, and a NullTokenizer with the plan's vocabulary; DATA_ARGS /
TRAINING_ARGS placeholders) for the Megatron-LM release --megatron-version names (default the newest): its flag
names, its entry points (pretrain_t5.py is examples/t5/pretrain_t5.py from 0.18) and its rules (Megatron FSDP runs
the distributed optimizer from 0.18); the header names the release. --args-only prints just the arguments on one
line. megatron-bridge: Megatron-Bridge v0.3.1 recipe overrides as a
YAML file (a hybrid model with --hybrid-pattern: Bridge v0.6.0's, '|' stage cuts); --args-only prints them as
run_recipe.py CLI overrides. A plan stock Megatron-LM cannot run (tp or dp
differing between stages, a stage cut inside a layer, per-unit recompute Megatron-LM has no setting for) is refused
with exit 2 and one line; search with --target megatron-lm for one it can. aceso-legacy: the Aceso reference's
op-level config JSON (each unit's ops at the stage's tp/dp; see docs/compat.md). See docs/megatron.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from search.io.errors import AcesoError
from search.spec.plan import load_plan
from .common import add_calibration_arg, add_megatron_version_arg, calibrated, check_output, write_output

TARGETS = ("megatron-lm", "megatron-bridge", "aceso-legacy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--to", default="megatron-lm", choices=TARGETS,
                   help="megatron-lm (a launch script, the default), megatron-bridge (recipe overrides YAML) or "
                        "aceso-legacy (the Aceso reference's op-level config JSON)")
    add_megatron_version_arg(p, "to write for (--to megatron-lm)")
    p.add_argument("--hybrid-pattern", action="store_true",
                   help="megatron-lm: write the plan as a hybrid-pattern run (pretrain_hybrid.py "
                        "--hybrid-layer-pattern '*-*-|*-...', Megatron-LM 0.17 or newer), whose '|' cuts stages "
                        "anywhere, also inside a layer; HybridModel checkpoints (docs/megatron.md); a model with "
                        "Mamba-2 or GDN layers is always written so; megatron-bridge, a hybrid model: Bridge v0.6.0 "
                        "overrides with hybrid_layer_pattern's '|' cuts")
    p.add_argument("--args-only", action="store_true",
                   help="megatron-lm: only the arguments, one shell-quoted line; megatron-bridge: the CLI overrides")
    p.add_argument("-o", "--output", default="-", help="file to write, or - for stdout")
    add_calibration_arg(p)


def run(args: argparse.Namespace) -> int:
    check_output(args.output)
    plan = load_plan(args.plan)
    from search.layers.moe_spec import refuse_unpriced
    refuse_unpriced(plan.model)     # exported flags would run a model nobody priced (docs/moe.md)
    from ..layers.hybrid import export_refusal
    why = export_refusal(plan.model, args.to)
    if why:
        raise AcesoError(why)
    if args.calibration and plan.cluster is not None:     # the header's prediction on the calibrated cluster
        from .import_cmd import predict
        plan = plan.model_copy(update={"cluster": calibrated(args, plan.cluster)})
        plan = plan.model_copy(update={"predicted": predict(plan, plan.predicted.attention if plan.predicted
                                                           else None)})
    if args.to == "aceso-legacy":
        if args.args_only:
            raise AcesoError("--args-only is for --to megatron-lm / megatron-bridge; aceso-legacy writes a JSON config")
        from ..compat.mapping import plan_to_ref
        write_output(plan_to_ref(plan).to_json(), args.output)
        return 0
    from ..megatron.script import args_line, write_script
    from ..megatron.versions import release
    if args.megatron_version is not None and args.to != "megatron-lm":
        raise AcesoError(f"--megatron-version is for --to megatron-lm; --to {args.to} writes for "
                         + ("Megatron-Bridge v0.3.1 (v0.6.0 with --hybrid-pattern)" if args.to == "megatron-bridge"
                            else "the Aceso reference"))
    rel = release(args.megatron_version)
    source = Path(args.plan).name
    from ..megatron.hybrid_pattern import runs_as_pattern
    if args.hybrid_pattern or (args.to == "megatron-lm" and runs_as_pattern(plan.model)):
        return _hybrid(args, plan, rel, source)     # a Mamba / GDN model's only Megatron-LM form: pretrain_hybrid.py
    if args.to == "megatron-bridge" and plan.model.mamba is not None:
        from ..megatron.bridge import cli_overrides, write_yaml
        from ..megatron.bridge_hybrid import BRIDGE_CORE, PIPES, needs_pipes, overrides
        gap = needs_pipes(plan)              # NotExpressible: exit 2, one line, nothing written
        if gap:
            print(f"aceso export: note: written for {PIPES} (HybridModelProvider): Bridge v0.3.1 does not run this "
                  f"plan ({gap})", file=sys.stderr)
            return _hybrid(args, plan, rel, source)
        recipe, cfg, ov = overrides(plan)
        text = cli_overrides(cfg, (recipe, ov)) if args.args_only else write_yaml(
            as_written(plan, cfg, "megatron-bridge", BRIDGE_CORE), cfg, source, (recipe, ov))
        write_output(text, args.output)
        return 0
    cfg = _gpt_config(plan, rel, args.to)    # NotExpressible: exit 2, one line, nothing written
    if args.to == "megatron-lm":
        text = args_line(cfg, rel) if args.args_only else write_script(
            as_written(plan, cfg, "megatron-lm", rel.series), cfg, source, rel)
        low = plan.settings.low_precision
        if args.args_only and low is not None and low.per_module:
            from ..megatron.names import TE_CONFIG_FILE
            print(f"aceso export: note: the arguments read {TE_CONFIG_FILE} (--te-precision-config-file, the plan's "
                  "per-module precision overrides), which they do not carry: the script export (without --args-only) "
                  "writes it; or point the flag at your own file with the same matchers", file=sys.stderr)
    else:
        from ..megatron.bridge import cli_overrides, write_yaml
        from ..megatron.bridge_hybrid import BRIDGE_CORE
        text = cli_overrides(cfg) if args.args_only else write_yaml(
            as_written(plan, cfg, "megatron-bridge", BRIDGE_CORE), cfg, source)
    write_output(text, args.output)
    if args.to == "megatron-lm" and not args.args_only:
        _executable(args.output)
    return 0


def as_written(plan, cfg, target: str, core: str):
    """``plan`` priced as ``target`` runs its exported file (``names.written_settings``: that framework, the
    megatron-core ``core`` the file is written for, the DP alignment as written), so that the file's header says
    what its import and ``explain`` price: re-priced, with a note on stderr, where that differs from the plan's own
    pricing (a runtime plan's alignment, which Bridge v0.3.1 cannot turn off; another release than the plan's)."""
    from search.costmodel.plan_view import describe, run_settings
    from ..megatron.names import written_settings
    from ..megatron.script import written_settings as script_settings
    from ..megatron.versions import release
    # Megatron-LM: the flags already say the plan's alignment (names._dp_written); the release can differ, and a
    # runtime plan's interleaved p2p (synchronous on the runtime: runtime_rules.overlap_p2p) runs Megatron-LM's
    # overlapped default unless the plan turned it off (--no-overlap-p2p-communication)
    if target == "megatron-lm":
        settings = plan.settings.model_copy(update={"release": core})
        if cfg.vpp > 1 and settings.overlap_p2p_comm is None:
            settings = settings.model_copy(update={"overlap_p2p_comm": True})
        settings = script_settings(settings, release(core))
    else:
        settings = written_settings(cfg, target, core)
    dtype, was = plan.model.params_dtype, plan.predicted
    same = run_settings(settings, dtype) == run_settings(plan.settings, dtype)
    if same:
        return plan
    out = plan.model_copy(update={"settings": settings})
    if was is None:
        return out
    from .import_cmd import predict
    out = out.model_copy(update={"predicted": predict(out, was.attention)})
    print(f"aceso export: note: the header prices the plan as this file runs ({describe(settings, dtype)}): "
          f"{out.predicted.iteration_time_ms:.1f} ms per iteration; the plan says {was.iteration_time_ms:.1f} ms, "
          f"priced as {describe(plan.settings, dtype)}", file=sys.stderr)
    return out


def _executable(path) -> None:
    """A written launch script becomes executable wherever it is readable."""
    if path not in (None, "-") and os.path.isfile(path):
        mode = os.stat(path).st_mode
        os.chmod(path, mode | (mode & 0o444) >> 2)


def _gpt_config(plan, rel, to: str):
    """``megatron_config``; a plan cut inside a layer that a hybrid pattern runs says so in its refusal (for
    ``--to megatron-bridge``: Megatron-LM's form, since Bridge runs a GPT model's pattern in no form)."""
    from ..megatron import NotExpressible, megatron_config
    from ..megatron.hybrid_pattern import hybrid_form
    try:
        return megatron_config(plan)
    except NotExpressible as e:
        if "places whole layers" not in str(e):
            raise
        try:
            hybrid_form(plan, rel)
        except NotExpressible:
            raise e from None
        how = "--hybrid-pattern" if to == "megatron-lm" else "--to megatron-lm --hybrid-pattern"
        raise NotExpressible(f"{e}; or export it with {how} (pretrain_hybrid.py '|' cuts, {rel.label}; "
                             "HybridModel checkpoints)") from None


def _hybrid(args, plan, rel, source) -> int:
    from ..megatron.hybrid_pattern import args_line, hybrid_form, write_script
    if args.to == "megatron-bridge" and plan.model.mamba is not None:     # Bridge v0.6.0's '|' cuts
        from ..megatron.bridge import cli_overrides, write_yaml
        from ..megatron.bridge_hybrid import PIPES, PIPES_CORE, overrides
        recipe, cfg, ov = overrides(plan, pipes=True)     # NotExpressible: exit 2, one line, nothing written
        write_output(cli_overrides(cfg, (recipe, ov)) if args.args_only
                     else write_yaml(as_written(plan, cfg, "megatron-bridge", PIPES_CORE), cfg, source, (recipe, ov),
                                     (PIPES, PIPES_CORE)), args.output)
        return 0
    if args.to != "megatron-lm":
        raise AcesoError(f"--hybrid-pattern is for --to megatron-lm (pretrain_hybrid.py) and, for a hybrid model, "
                         f"--to megatron-bridge (v0.6.0); --to {args.to} has no hybrid-pattern form here")
    form = hybrid_form(plan, rel)        # NotExpressible: exit 2, one line naming the release, nothing written
    write_output(args_line(form) if args.args_only
                 else write_script(as_written(plan, form.config, "megatron-lm", rel.series), form, source), args.output)
    if not args.args_only:
        _executable(args.output)
    return 0
