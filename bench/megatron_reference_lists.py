"""Regenerate the two reference lists aceso checks against, from fetched checkouts (nothing of theirs is committed):

* ``search/megatron/data/flags_core_v0.16.1.txt``: every ``--flag`` of Megatron-LM's parser at core_v0.16.1
  (``megatron.training.arguments.add_megatron_arguments``, the parser ``pretrain_gpt.py`` / ``pretrain_t5.py``
  build; the ModelOpt extras that ``pretrain_gpt.py`` adds only when nvidia-modelopt is installed are left out).
  Built by running the parser itself (its flags partly come from config dataclasses through
  ``ArgumentGroupFactory``), with megatron-core 0.16.1 installed; ``megatron/training`` and ``megatron/legacy`` are
  taken from the checkout without importing ``megatron.training/__init__`` (which needs triton).
* ``search/megatron/data/bridge_fields_v0.3.1.json``: the fields of the Megatron-Bridge ``ConfigContainer``
  sections the Bridge export writes, read with ``ast`` from ``src/megatron/bridge`` and its megatron-core base
  classes (``3rdparty/Megatron-LM``, the core_v0.16.1 commit), following dataclass inheritance; and the
  ``mixed_precision`` recipe names (``@register`` functions of ``training/mixed_precision.py``).

    python bench/megatron_reference_lists.py --megatron-lm /path/Megatron-LM --bridge /path/Megatron-Bridge

Each path is a work tree at the tag (``git worktree add`` / ``git archive core_v0.16.1 | tar -x``); give either.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from search.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors, as Megatron-LM's own)

DATA = os.path.join(HERE, "..", "search", "megatron", "data")
MLM_TAG, BRIDGE_TAG = "core_v0.16.1", "v0.3.1"
COMMITS = {MLM_TAG: "55ac7082517c3878ae653c07c09c534b8aed49f6", BRIDGE_TAG: "9c9dd848966322fc3ed7706747ec13219ef49dda"}

# ConfigContainer section -> the dataclass the export's values land in (v0.3.1 config.py / model providers)
SECTIONS = {
    "train": "megatron/bridge/training/config.py:TrainingConfig",
    "dataset": "megatron/bridge/training/config.py:GPTDatasetConfig",
    "tokenizer": "megatron/bridge/training/tokenizers/config.py:TokenizerConfig",
    "ddp": "megatron/bridge/training/config.py:DistributedDataParallelConfig",
    "optimizer": "megatron/bridge/training/config.py:OptimizerConfig",
    "comm_overlap": "megatron/bridge/training/comm_overlap.py:CommOverlapConfig",
    "mixed_precision": "megatron/bridge/training/mixed_precision.py:MixedPrecisionConfig",
    "model": "megatron/bridge/models/gpt_provider.py:GPTModelProvider",
    "checkpoint": "megatron/bridge/training/config.py:CheckpointConfig",
}


def _commit(path: str, tag: str) -> str:
    """The tag's commit; a git work tree at another commit is refused (an archive is taken as the tag's)."""
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return COMMITS[tag]
    if head != COMMITS[tag]:
        raise SystemExit(f"{path} is at {head}, not {tag} ({COMMITS[tag]})")
    return head


def megatron_flags(root: str) -> list[str]:
    sys.path.insert(0, root)
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = [os.path.join(root, "megatron", "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume", "get_tokenizer", "print_rank_0",
                 "get_tensorboard_writer", "get_wandb_writer", "get_one_logger"):
        setattr(pkg, name, lambda *a, **k: None)
    sys.modules["megatron.training"] = pkg
    from megatron.training.arguments import add_megatron_arguments
    parser = add_megatron_arguments(AcesoParser())
    return sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"})


class _Classes:
    """Dataclass fields by ``ast``: a class's annotated assignments plus its bases', resolved through imports."""

    def __init__(self, roots: list[str]):
        self.roots = roots

    def _module(self, dotted: str):
        for root in self.roots:
            for cand in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
                path = os.path.join(root, cand)
                if os.path.exists(path):
                    return path, ast.parse(open(path).read())
        return None, None

    def fields(self, dotted: str, name: str, seen=None) -> list[str]:
        seen = seen if seen is not None else set()
        path, tree = self._module(dotted)
        if tree is None or (dotted, name) in seen:
            return []
        seen.add((dotted, name))
        imports = {}
        package = dotted if path.endswith("__init__.py") else dotted.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                for a in node.names:
                    imports[a.asname or a.name] = (mod, a.name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                out: list[str] = []
                for base in node.bases:
                    bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    mod, real = imports.get(bname, (dotted, bname))
                    out += self.fields(mod, real, seen)
                out += [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and "ClassVar" not in ast.unparse(s.annotation)]
                return list(dict.fromkeys(out))
        if name in imports:                       # re-exported
            return self.fields(imports[name][0], imports[name][1], seen)
        return []


def bridge_fields(root: str) -> dict[str, list[str]]:
    classes = _Classes([os.path.join(root, "src"), os.path.join(root, "3rdparty", "Megatron-LM")])
    out = {}
    for section, where in SECTIONS.items():
        path, name = where.split(":")
        out[section] = sorted(classes.fields(path[:-3].replace("/", "."), name))
        if not out[section]:
            raise SystemExit(f"{section}: no fields found for {where}; is {root} Megatron-Bridge {BRIDGE_TAG}?")
    tree = ast.parse(open(os.path.join(root, "src", "megatron", "bridge", "training", "mixed_precision.py")).read())
    out["mixed_precision_recipes"] = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                                            and any(getattr(d, "id", None) == "register" for d in n.decorator_list))
    return out


def main(argv=None) -> int:
    ap = AcesoParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-lm", help=f"a Megatron-LM work tree at {MLM_TAG}")
    ap.add_argument("--bridge", help=f"a Megatron-Bridge work tree at {BRIDGE_TAG}")
    args = ap.parse_args(argv)
    os.makedirs(DATA, exist_ok=True)
    if args.megatron_lm:
        flags = megatron_flags(os.path.abspath(args.megatron_lm))
        with open(os.path.join(DATA, f"flags_{MLM_TAG}.txt"), "w") as f:
            f.write(f"# Megatron-LM {MLM_TAG} (commit {_commit(args.megatron_lm, MLM_TAG)}): every flag of "
                    "megatron/training/arguments.py add_megatron_arguments; written by "
                    "bench/megatron_reference_lists.py\n")
            f.write("\n".join(flags) + "\n")
        print(f"{len(flags)} Megatron-LM flags")
    if args.bridge:
        fields = bridge_fields(os.path.abspath(args.bridge))
        with open(os.path.join(DATA, f"bridge_fields_{BRIDGE_TAG}.json"), "w") as f:
            json.dump({"source": f"NVIDIA-NeMo/Megatron-Bridge {BRIDGE_TAG} (commit {_commit(args.bridge, BRIDGE_TAG)}), "
                                 "dataclass fields with their bases; written by bench/megatron_reference_lists.py",
                       "sections": SECTIONS, "fields": fields}, f, indent=1)
            f.write("\n")
        print(" ".join(f"{k}: {len(v)}" for k, v in fields.items()))
    if not (args.megatron_lm or args.bridge):
        ap.error("give --megatron-lm and/or --bridge")
    return 0


if __name__ == "__main__":
    sys.exit(main())
