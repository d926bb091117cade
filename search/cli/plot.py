"""Draw a training run's picture from its JSON-lines log: loss, step time, predicted vs measured memory per stage.

  aceso plot train.jsonl                    # writes train.png beside the log
  aceso plot train.jsonl -o run.svg         # the format follows the extension (png, svg, pdf)

The log is what `aceso train --log-file FILE` writes (docs/train.md, "Logs"); `aceso train --plot FILE` draws the
same picture at the end of a run. Needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import plots


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="JSON-lines log of aceso train (--log-file)")
    p.add_argument("-o", "--output", default=None, help="image file (.png, .svg, .pdf); default: LOG with .png")
    p.add_argument("--plot-format", choices=plots.FORMATS, default=None,
                   help="image format (default: from the output's extension)")


def run(args: argparse.Namespace) -> int:
    out = args.output or str(Path(args.log).with_suffix(".png"))
    plots.draw_training(args.log, out, args.plot_format, option="-o")
    print(f"wrote {out}")
    return 0
