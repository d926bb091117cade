"""Regenerate the reference lists aceso checks against, from fetched checkouts (nothing of theirs is committed):

* ``search/megatron/data/megatron_lm_<TAG>.json``, one per Megatron-LM release (``search/megatron/versions.py``
  reads them): every ``--flag`` of the release's parser (``megatron.training.arguments.add_megatron_arguments``,
  the parser ``pretrain_gpt.py`` / ``pretrain_t5.py`` build; the ModelOpt extras that ``pretrain_gpt.py`` adds only
  when nvidia-modelopt is installed are left out) with its ``dest``, action, default, ``nargs``, type and choices,
  and where the release keeps each ``pretrain_*.py`` entry point. Built by running the parser itself (its flags
  partly come from config dataclasses through ``ArgumentGroupFactory``) in a child Python whose ``PYTHONPATH`` is
  the checkout, so the release's own ``megatron/core`` is imported (``--python``: an interpreter with torch; the
  releases after 0.16.1 need Python >= 3.12); ``megatron/training/__init__`` (which needs triton) is not imported.
* ``search/megatron/data/bridge_fields_v0.3.1.json``: the fields of the Megatron-Bridge ``ConfigContainer``
  sections the Bridge export writes, read with ``ast`` from ``src/megatron/bridge`` and its megatron-core base
  classes (``3rdparty/Megatron-LM``, the core_v0.16.1 commit), following dataclass inheritance; the properties with
  a setter (``settable``: a YAML override sets them through ``setattr``); and the ``mixed_precision`` recipe names
  (``@register`` functions of ``training/mixed_precision.py``), the model section of the Nemotron-H recipes
  (``hybrid_model``: ``NemotronHModelProvider``) and the pretraining recipe functions (``pretrain_recipes``).

    python bench/megatron_reference_lists.py --megatron-lm /path/core_v0.19.0 [--tag core_v0.19.0] \\
        [--python /path/venv/bin/python] --bridge /path/Megatron-Bridge

Each path is a work tree at the tag (``git worktree add``) or an extracted archive (``git archive TAG | tar -x``;
then give ``--tag``, or name the folder after the tag); ``--megatron-lm`` may be given several times.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

DATA = os.path.join(HERE, "..", "search", "megatron", "data")
BRIDGE_TAG = "v0.3.1"
COMMITS = {"core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
           "core_v0.17.1": "266f1c97dca477ca8b92c16087506da2000b0b84",
           "core_v0.18.2": "571370c829ca768fe37244f4e2e7f28d8accc4ab",
           "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
           BRIDGE_TAG: "9c9dd848966322fc3ed7706747ec13219ef49dda"}

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
    # the model section of the Nemotron-H / Nemotron-3 recipes (search/megatron/bridge_hybrid.py)
    "hybrid_model": "megatron/bridge/models/nemotronh/nemotron_h_provider.py:NemotronHModelProvider",
}


def _commit(path: str, tag: str) -> str:
    """The tag's commit: a git work tree's HEAD (refused when it is not the known commit of the tag); an archive
    is taken as the tag's."""
    try:
        top, head = subprocess.run(["git", "-C", path, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                   text=True, check=True).stdout.split()
        if os.path.realpath(top) != os.path.realpath(path):
            raise FileNotFoundError(top)         # a folder inside another repository: an archive
    except (subprocess.CalledProcessError, FileNotFoundError, ValueError):
        if tag not in COMMITS:
            raise SystemExit(f"{path}: not a git work tree and {tag} is not a known tag ({', '.join(COMMITS)}); "
                             "use a work tree (git worktree add) or add the tag's commit to COMMITS") from None
        return COMMITS[tag]
    if tag in COMMITS and head != COMMITS[tag]:
        raise SystemExit(f"{path} is at {head}, not {tag} ({COMMITS[tag]})")
    return head


# -- Megatron-LM: run in the child (PYTHONPATH = the checkout)

_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false",
            "_StoreConstAction": "store_const", "_AppendAction": "append", "_CountAction": "count",
            "BooleanOptionalAction": "boolean_optional"}


def _plain(v):
    """A default or choice as JSON: itself where JSON has it, an enum member's name (as the parser's type reads
    it), else ``{"repr": ...}`` (a torch dtype, a function)."""
    import enum
    if isinstance(v, enum.Enum):
        return v.name
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return {"repr": repr(v)}


def dump_parser(root: str) -> dict:
    """Every ``--flag`` of ``add_megatron_arguments`` (this process imports the checkout at ``root``)."""
    sys.path.insert(0, root)
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = [os.path.join(root, "megatron", "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume", "get_tokenizer", "print_rank_0",
                 "get_tensorboard_writer", "get_wandb_writer", "get_one_logger"):
        setattr(pkg, name, lambda *a, **k: None)
    sys.modules["megatron.training"] = pkg
    import megatron.core
    from megatron.training.arguments import add_megatron_arguments
    if not os.path.abspath(megatron.core.__file__).startswith(os.path.abspath(root)):
        raise SystemExit(f"megatron.core came from {megatron.core.__file__}, not the checkout {root}")
    from search.io.argparser import AcesoParser      # no abbreviations, as Megatron-LM's own parser
    parser = add_megatron_arguments(AcesoParser())
    flags = {}
    for a in parser._actions:
        for s in a.option_strings:
            if not s.startswith("--") or s == "--help":
                continue
            rec = {"dest": a.dest, "action": _ACTIONS.get(type(a).__name__, type(a).__name__),
                   "default": _plain(a.default)}
            if a.nargs not in (None, 0):
                rec["nargs"] = a.nargs
            if a.type is not None:
                rec["type"] = getattr(a.type, "__name__", str(a.type))
            if a.choices is not None:
                rec["choices"] = [_plain(c) for c in a.choices]
            flags[s] = rec           # absent nargs / type / choices: argparse's None (a flag, or one string)
    return {"megatron_core": megatron.core.__version__, "flags": dict(sorted(flags.items()))}


def entry_points(root: str) -> dict[str, str]:
    """``pretrain_*.py`` -> its path in the checkout (tests excluded; the shortest path where a name repeats)."""
    found: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("tests", ".git"))
        for f in files:
            if f.startswith("pretrain_") and f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)
                if f not in found or len(rel) < len(found[f]):
                    found[f] = rel
    return dict(sorted(found.items()))


def megatron_release(root: str, tag: str, python: str) -> dict:
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run([python, os.path.abspath(__file__), "--dump-parser", root], capture_output=True, text=True,
                       env=env)
    if r.returncode:
        raise SystemExit(f"{tag}: the parser did not run ({python}):\n{r.stderr[-3000:]}")
    parsed = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tag": tag, "commit": _commit(root, tag), "megatron_core": parsed["megatron_core"],
            "source": f"NVIDIA/Megatron-LM {tag}: every flag of megatron/training/arguments.py "
                      "add_megatron_arguments (dest, action, default, nargs, type, choices) and the pretrain_*.py "
                      "entry points; written by bench/megatron_reference_lists.py",
            "entry_points": entry_points(root), "flags": parsed["flags"]}


def write_release(rel: dict) -> str:
    """One line per flag, so a regenerated file diffs flag by flag."""
    path = os.path.join(DATA, f"megatron_lm_{rel['tag']}.json")
    head = {k: v for k, v in rel.items() if k != "flags"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "flags": {']
    items = list(rel["flags"].items())
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(items) - 1 else "")
              for i, (k, v) in enumerate(items)]
    lines += [" }", "}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


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

    def fields(self, dotted: str, name: str) -> list[str]:
        return self.members(dotted, name)[0]

    def members(self, dotted: str, name: str, seen=None) -> tuple[list[str], list[str]]:
        """(dataclass fields, properties with a setter) of the class and its bases."""
        seen = seen if seen is not None else set()
        path, tree = self._module(dotted)
        if tree is None or (dotted, name) in seen:
            return [], []
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
                setters: list[str] = []
                for base in node.bases:
                    bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    mod, real = imports.get(bname, (dotted, bname))
                    f, st = self.members(mod, real, seen)
                    out, setters = out + f, setters + st
                out += [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and "ClassVar" not in ast.unparse(s.annotation)]
                setters += [s.name for s in node.body if isinstance(s, ast.FunctionDef)
                            and any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in s.decorator_list)]
                return list(dict.fromkeys(out)), list(dict.fromkeys(setters))
        if name in imports:                       # re-exported
            return self.members(imports[name][0], imports[name][1], seen)
        return [], []


def bridge_fields(root: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(fields by section + the mixed-precision recipe names + the pretraining recipe functions, settable
    properties by section)."""
    classes = _Classes([os.path.join(root, "src"), os.path.join(root, "3rdparty", "Megatron-LM")])
    out, settable = {}, {}
    for section, where in SECTIONS.items():
        path, name = where.split(":")
        fields, setters = classes.members(path[:-3].replace("/", "."), name)
        out[section] = sorted(fields)
        if setters:
            settable[section] = sorted(setters)
        if not out[section]:
            raise SystemExit(f"{section}: no fields found for {where}; is {root} Megatron-Bridge {BRIDGE_TAG}?")
    tree = ast.parse(open(os.path.join(root, "src", "megatron", "bridge", "training", "mixed_precision.py")).read())
    out["mixed_precision_recipes"] = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                                            and any(getattr(d, "id", None) == "register" for d in n.decorator_list))
    recipes = os.path.join(root, "src", "megatron", "bridge", "recipes")
    out["pretrain_recipes"] = sorted({n.name for d, _, files in os.walk(recipes) for f in files if f.endswith(".py")
                                      for n in ast.parse(open(os.path.join(d, f)).read()).body
                                      if isinstance(n, ast.FunctionDef) and n.name.endswith("_pretrain_config")})
    return out, settable


def main(argv=None) -> int:
    from search.io.argparser import AcesoParser     # no abbreviations, one-line errors, as Megatron-LM's own
    ap = AcesoParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-lm", action="append", default=[],
                    help="a Megatron-LM checkout at a release tag (repeatable)")
    ap.add_argument("--tag", action="append", default=[],
                    help="the tag of each --megatron-lm, in order (default: git's tag, else the folder's name)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter that runs each release's parser (needs torch; Python >= 3.12 after 0.16)")
    ap.add_argument("--bridge", help=f"a Megatron-Bridge work tree at {BRIDGE_TAG}")
    ap.add_argument("--dump-parser", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dump_parser:                          # the child: print the parser as JSON
        print(json.dumps(dump_parser(os.path.abspath(args.dump_parser))))
        return 0
    if not (args.megatron_lm or args.bridge):
        ap.error("give --megatron-lm and/or --bridge")
    if args.tag and len(args.tag) != len(args.megatron_lm):
        ap.error("give one --tag per --megatron-lm, or none")
    os.makedirs(DATA, exist_ok=True)
    for k, root in enumerate(args.megatron_lm):
        root = os.path.abspath(root)
        tag = args.tag[k] if args.tag else _tag(root)
        rel = megatron_release(root, tag, args.python)
        print(f"{tag}: {len(rel['flags'])} flags, entry points {' '.join(rel['entry_points'].values())} -> "
              f"{write_release(rel)}")
    if args.bridge:
        fields, settable = bridge_fields(os.path.abspath(args.bridge))
        with open(os.path.join(DATA, f"bridge_fields_{BRIDGE_TAG}.json"), "w") as f:
            json.dump({"source": f"NVIDIA-NeMo/Megatron-Bridge {BRIDGE_TAG} (commit {_commit(args.bridge, BRIDGE_TAG)}), "
                                 "dataclass fields with their bases, and the properties with a setter ('settable'); "
                                 "written by bench/megatron_reference_lists.py",
                       "sections": SECTIONS, "fields": fields, "settable": settable}, f, indent=1)
            f.write("\n")
        print(" ".join(f"{k}: {len(v)}" for k, v in fields.items()), "settable:", settable)
    return 0


def _tag(root: str) -> str:
    try:
        return subprocess.run(["git", "-C", root, "describe", "--tags", "--exact-match"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        name = os.path.basename(root.rstrip("/"))
        if not name.startswith("core_v"):
            raise SystemExit(f"{root}: give its --tag (not a git work tree at a tag, nor a folder named after "
                             "one)") from None
        return name


if __name__ == "__main__":
    sys.exit(main())
