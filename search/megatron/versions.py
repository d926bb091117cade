"""Megatron-LM releases as data: each release's flags, defaults and entry points, one generated file per release.

``data/megatron_lm_<TAG>.json`` is what the release's own parser builds (``add_megatron_arguments``: every
``--flag`` with its ``dest``, action, default, ``nargs``, type, choices) and where it keeps each ``pretrain_*.py``
(``pretrain_t5.py`` moved to ``examples/t5/`` in 0.18); ``bench/megatron_reference_lists.py`` writes them by
running each release's parser. Adding a release is adding its file. One tag stands for its minor series (the
parser of megatron-core 0.19.2's wheel is core_v0.19.0's, file for file), so ``--megatron-version 0.19``,
``0.19.2`` and ``core_v0.19.0`` are the same release; no version given means the newest.

What a release's parser does not show but ``validate_args`` does, and a plan's price depends on, is a rule here
with the release that brought it (``RULES``), read by ``Release.rule``. Flags renamed between releases are in
``RENAMED``: the import names the new one, the export writes the name the target release has (``flag_name``).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field

from search.io.errors import AcesoError

DATA = os.path.join(os.path.dirname(__file__), "data")

# rule -> (the first release with it, what it is; Megatron-LM megatron/training/arguments.py validate_args)
RULES: dict[str, tuple[tuple[int, int], str]] = {
    "fsdp_forces_distributed_optimizer": (
        (0, 18), "--use-megatron-fsdp turns on the distributed optimizer ('Megatron-FSDP is only compatible with "
                 "--use-distributed-optimizer. Using DistributedOptimizer...')"),
    # megatron/core/tokenizers/text/libraries/null_tokenizer.py: before 0.18 vocab_size is --vocab-size + 1 (the EOD
    # token after them), from 0.18 --vocab-size (the EOD token its last id)
    "null_tokenizer_counts_eod": (
        (0, 18), "NullTokenizer's vocabulary is --vocab-size, its EOD token included (before: --vocab-size + 1)"),
    # core_v0.18.2 arguments.py:1529, core_v0.19.0 arguments.py:1643: validate_args asserts it off
    "te_cross_entropy_refused": (
        (0, 18), "--cross-entropy-fusion-impl te is refused ('Transformer Engine cross entropy loss fusion is disabled "
                 "due to stability issues. Use --cross-entropy-fusion-impl native')"),
    # core_v0.16.1 arguments.py:1158, core_v0.17.1 :1458 assert the (inference-only) flag with --cuda-graph-impl local
    # and --expert-model-parallel-size > 1; core_v0.18.2 and core_v0.19.0 no longer do
    "local_graphs_ep_need_no_inference_pad": (
        (0, 18), "--cuda-graph-impl local with --expert-model-parallel-size > 1 runs without "
                 "--moe-pad-experts-for-cuda-graph-inference (before: 'must be set when using CUDA graphs with expert "
                 "parallelism'; the flag only pads experts in inference)"),
}

# deprecated or removed flag -> its replacement (the releases that have each are in the data)
RENAMED: dict[str, str] = {
    "--cuda-graph-scope": "--cuda-graph-modules",             # 0.18 (--cuda-graph-scope kept, deprecated)
    "--moe-deepep-num-sms": "--moe-flex-dispatcher-num-sms",  # 0.19 (kept, deprecated)
    "--moe-hybridep-num-sms": "--moe-flex-dispatcher-num-sms",
    "--inference-max-batch-size": "--inference-max-requests",  # removed in 0.17
    "--hybrid-override-pattern": "--hybrid-layer-pattern",    # 0.17 (kept, deprecated)
}


@dataclass(frozen=True)
class Flag:
    """One flag of a release's parser (argparse's fields; ``nargs`` None: one value, 0: none)."""

    dest: str
    action: str                       # store, store_true, store_false, store_const, append, ...
    default: object = None
    nargs: object = None
    type: str | None = None
    choices: tuple | None = None

    @property
    def takes_value(self) -> bool:
        return self.action in ("store", "append")


@dataclass(frozen=True)
class Release:
    tag: str                          # core_v0.19.0
    commit: str
    megatron_core: str                # the checkout's megatron/core/package_info.py
    entry_points: dict[str, str] = field(repr=False)     # pretrain_t5.py -> examples/t5/pretrain_t5.py
    flags: dict[str, Flag] = field(repr=False)

    @property
    def version(self) -> tuple[int, int]:
        major, minor = re.match(r"core_v(\d+)\.(\d+)", self.tag).groups()
        return int(major), int(minor)

    @property
    def series(self) -> str:
        """``0.19``: what ``--megatron-version`` names it by."""
        return "%d.%d" % self.version

    @property
    def label(self) -> str:
        return f"Megatron-LM {self.tag}"

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def default(self, flag: str):
        """The parser's default of ``flag`` (None for a flag this release does not have)."""
        f = self.flags.get(flag)
        return f.default if f else None

    def rule(self, name: str) -> bool:
        return self.version >= RULES[name][0]

    def null_vocab(self, vocab_size_flag: int) -> int:
        """The vocabulary of ``--tokenizer-type NullTokenizer --vocab-size N``."""
        return vocab_size_flag + (0 if self.rule("null_tokenizer_counts_eod") else 1)

    def entry_path(self, script: str) -> str:
        """Where this release keeps ``script`` (``pretrain_t5.py`` -> ``examples/t5/pretrain_t5.py`` from 0.18)."""
        try:
            return self.entry_points[script]
        except KeyError:
            raise AcesoError(f"{script}: not in {self.label} (its entry points: "
                             f"{', '.join(sorted(self.entry_points))})") from None

    def flag_name(self, flag: str) -> str:
        """The name this release reads ``flag`` by: a renamed flag's replacement where the release has it, the
        one flag it replaced where the release has only that one, else ``flag``."""
        new = RENAMED.get(flag)
        if new and self.has(new):
            return new
        olds = [old for old, n in RENAMED.items() if n == flag]
        if not self.has(flag) and len(olds) == 1 and self.has(olds[0]):
            return olds[0]
        return flag

    def closest(self, flag: str) -> str | None:
        close = difflib.get_close_matches(flag, sorted(self.flags), n=1, cutoff=0.75)
        return close[0] if close else None


def _load(path: str) -> Release:
    with open(path) as f:
        d = json.load(f)
    flags = {k: Flag(dest=v["dest"], action=v["action"], default=v.get("default"), nargs=v.get("nargs"),
                     type=v.get("type"), choices=tuple(v["choices"]) if v.get("choices") is not None else None)
             for k, v in d["flags"].items()}
    return Release(tag=d["tag"], commit=d["commit"], megatron_core=d["megatron_core"],
                   entry_points=dict(d["entry_points"]), flags=flags)


def tags() -> list[str]:
    """The releases' tags, oldest first, from the data files' names (nothing loaded: the CLI's help lists them)."""
    found = [n[len("megatron_lm_"):-len(".json")] for n in os.listdir(DATA)
             if n.startswith("megatron_lm_") and n.endswith(".json")]
    return sorted(found, key=lambda t: tuple(int(x) for x in re.findall(r"\d+", t)))


@functools.cache
def releases() -> tuple[Release, ...]:
    """Every release with a data file, oldest first."""
    return tuple(_load(os.path.join(DATA, f"megatron_lm_{t}.json")) for t in tags())


def newest() -> Release:
    return releases()[-1]


def release(name: str | None = None) -> Release:
    """The release ``--megatron-version`` names: ``0.19``, ``0.19.2``, ``v0.19`` or ``core_v0.19.0`` (None: the
    newest). An unknown one is refused naming those there are."""
    if name is None:
        return newest()
    m = re.fullmatch(r"(?:core_)?v?(\d+)\.(\d+)(?:\.\d+)?(?:rc\d+)?", name.strip())
    if m:
        want = (int(m.group(1)), int(m.group(2)))
        for r in releases():
            if r.version == want:
                return r
    raise AcesoError(f"--megatron-version {name}: aceso knows Megatron-LM "
                     + ", ".join(f"{r.series} ({r.tag})" for r in releases()) + "; give one of them")


def having(flag: str) -> list[Release]:
    """The releases whose parser has ``flag``."""
    return [r for r in releases() if r.has(flag)]


def not_a_flag(flag: str, rel: Release) -> str:
    """The refusal of a flag ``rel``'s parser does not have: its closest flag there, and the releases that do have
    it (or its new name)."""
    msg = f"{flag}: not a flag of {rel.label} (its parser exits on it: unrecognized arguments)"
    if rel.flag_name(flag) != flag:
        return msg + f"; it is {rel.flag_name(flag)} there"
    close = rel.closest(flag)
    msg += f"; did you mean {close}?" if close else ""
    others = having(flag)
    if others:
        msg += (f" ({flag} is a flag of {', '.join(r.tag for r in others)}: give --megatron-version "
                f"{others[-1].series} for a script written for it)")
    return msg
