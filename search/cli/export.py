"""Convert a plan to the Aceso reference's op-level config: `aceso export PLAN --to aceso-legacy -o out.json`.

Each stage's units become the reference's ops (attention unit = layer ops 0-7, MLP unit = ops 8-12; T5 decoder
layers: self-attention 0-7, cross-attention 8-15, MLP 16-20), every op at the stage's tp/dp and algo 0, and each
unit's recompute choice becomes op flags (selective: attention core / gelu; full: all the unit's ops).
See docs/compat.md.
"""

from __future__ import annotations

import argparse

from ..plan import load_plan
from .common import check_output, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--to", default="aceso-legacy", choices=["aceso-legacy"],
                   help="target format (aceso-legacy: the reference's op-level config JSON)")
    p.add_argument("-o", "--output", default="-", help="file to write, or - for stdout")


def run(args: argparse.Namespace) -> int:
    from ..compat.mapping import plan_to_ref

    check_output(args.output)
    plan = load_plan(args.plan)
    write_output(plan_to_ref(plan).to_json(), args.output)
    return 0
