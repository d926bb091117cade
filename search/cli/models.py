"""List the built-in model presets; --show NAME prints one as a spec file to start from (--from-hf converts a
Hugging Face config.json)."""

from __future__ import annotations

import argparse

from model_specs import presets as model_presets

from search.io.argtypes import positive_int
from search.io.errors import AcesoError
from search.layers.moe_params import counts
from search.spec.presets import load_model, spec_text
from .common import print_json, print_rows, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--from-hf", metavar="CONFIG_JSON", help="convert a Hugging Face config.json (like import-hf)")
    p.add_argument("--show", metavar="NAME", help="print a preset (or a spec file) as a YAML spec file with every "
                   "field described (--json: JSON); edit it and pass it as --model FILE")
    p.add_argument("--num-layers", type=int, default=None, help="with --show: override the depth")
    p.add_argument("-o", "--output", default="-", help="with --from-hf or --show: spec file to write (default stdout)")
    p.add_argument("--seq-length", type=positive_int, default=None,
                   help="with --from-hf: training sequence length (default: the model's context, at most 4096)")


def run(args: argparse.Namespace) -> int:
    if args.from_hf:
        from .import_hf import convert_to_file
        return convert_to_file(args.from_hf, args.output, seq_length=args.seq_length, prog="aceso models")
    if args.seq_length is not None:
        raise AcesoError("--seq-length goes with --from-hf (a preset or spec file has its own seq_length)")
    if args.show:
        model = load_model(args.show, num_layers=args.num_layers)
        fmt = "json" if args.json or args.output.endswith(".json") else "yaml"
        write_output(spec_text(model, fmt, title=args.show), args.output)
        return 0
    rows = []
    models = [load_model(n) for n in model_presets.preset_names()]
    order = {"gpt": 0, "llama": 1, "t5": 2}
    for m in sorted(models, key=lambda m: (order[m.family], m.num_parameters)):
        name = m.name
        rows.append({
            "name": name, "family": m.family, "layers": m.num_layers if not m.is_t5
            else f"{m.num_layers}+{m.num_decoder_layers}", "hidden": m.hidden_size,
            "heads": m.num_attention_heads, "kv_groups": m.groups, "ffn": m.ffn_hidden_size,
            "seq": m.seq_length, "vocab": m.padded_vocab_size, "params_b": round(m.num_parameters / 1e9, 3),
            "active_b": round(counts(m).active / 1e9, 3),
            "experts": f"{m.moe.moe_router_topk}/{m.moe.num_experts}" if m.moe else None,
            "units": m.num_units, "aceso_db_key": m.aceso_db_key,
        })
    if args.json:
        print_json(rows)
        return 0
    print_rows("built-in models (--num-layers overrides the depth; active_b: parameters a token runs through, "
               "experts: routed top-k/all)", rows, left=("name", "family", "aceso_db_key"))
    return 0
