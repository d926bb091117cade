"""Read a Megatron-LM launch script (or a bare argument line) as far as a plan needs: the arguments of the
``pretrain_*.py`` call and the world size of its launcher.

A small subset of bash, enough for Megatron-LM's example scripts and ours: line continuations, comments,
assignments (``NAME=value``, ``export NAME=value``, arrays ``NAME=( ... )`` over several lines), expansions
``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME[@]}`` (``"$@"``, the script's own arguments, is empty). Nothing is executed and the environment is not read:
a variable the file does not set expands to ``<unset:NAME>``, so a plan argument that depends on one is reported.
The command is the last line that runs a ``.py`` file (``torchrun ... pretrain_gpt.py ARGS``, ``python ...``);
without one the whole text is the argument list. The launcher's ``--nproc-per-node``/``--nproc_per_node`` times
``--nnodes`` is the world size when both are numbers.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from ..errors import AcesoError

_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-a\s+)?|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Command:
    argv: list[str]                       # the entry script's arguments
    script: str | None = None             # e.g. pretrain_gpt.py
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    """Lines with continuations joined, comments stripped, and multi-line ``NAME=( ... )`` arrays joined."""
    text = re.sub(r"\\\r?\n", " ", text)
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = _strip_comment(raw).strip()
        if pending:
            pending += " " + line
            if _closed(pending):
                out.append(pending)
                pending = ""
            continue
        if not line:
            continue
        m = _ASSIGN.match(line)
        if m and m.group(2).startswith("(") and not _closed(line):
            pending = line
            continue
        out.append(line)
    if pending:
        raise AcesoError(f"the array assignment {pending[:40]!r}... is never closed with ')'")
    return out


def _strip_comment(line: str) -> str:
    """Drop a ``#`` comment that is not inside quotes and starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _closed(line: str) -> bool:
    depth = 0
    for tok in re.findall(r"\(|\)", re.sub(r"'[^']*'|\"[^\"]*\"", "", line)):
        depth += 1 if tok == "(" else -1
    return depth <= 0


def _expand(text: str, env: dict[str, list[str]]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        if name in env:
            vals = env[name]
            if m.group(2):                       # ${NAME[@]}: every element, each one word
                return " ".join(shlex.quote(v) for v in vals)
            return vals[0] if vals else ""
        if m.group(3) is not None:
            return m.group(3)
        return f"<unset:{name}>"
    text = re.sub(r'"\$[@*]"|\$[@*]', "", text)     # the script's own arguments: none when it is read
    for _ in range(8):                           # nested defaults such as ${A:-$B}
        new = _VAR.sub(sub, text)
        if new == text:
            break
        text = new
    return text


def _words(text: str, env: dict[str, list[str]], where: str) -> list[str]:
    """Expand, then split into words as bash would (``"${ARGS[@]}"``: one word per element)."""
    text = re.sub(r'"(\$\{[A-Za-z_][A-Za-z0-9_]*\[@\]\})"', r"\1", text)
    text = _expand(text, env)
    try:
        return shlex.split(text)
    except ValueError as e:
        raise AcesoError(f"{where}: cannot split {text[:60]!r} into words ({e})") from None


def read_command(text: str, source: str = "arguments") -> Command:
    env: dict[str, list[str]] = {}
    command: list[str] | None = None
    loose: list[str] = []                       # words of lines that are neither assignments nor a .py call
    for line in _logical_lines(text):
        m = _ASSIGN.match(line)
        if m:
            name, value = m.group(1), m.group(2).strip()
            if value.startswith("("):
                env[name] = _words(value[1:value.rindex(")")], env, source)
                continue
            words = _words(value, env, source)
            if len(words) <= 1:
                env[name] = words or [""]
                continue
            line = value                        # NAME=value command ...: the command, environment prefix dropped
        words = _words(line, env, source)
        while words and _ASSIGN.match(words[0]):
            words = words[1:]
        if any(w.endswith(".py") for w in words):
            command = words
        else:
            loose += words
    if command is None:
        return Command(argv=loose)
    k = max(i for i, w in enumerate(command) if w.endswith(".py"))
    script = command[k].rsplit("/", 1)[-1]
    return Command(argv=command[k + 1:], script=script, world_size=_world_size(command[:k]))


def _world_size(launcher: list[str]) -> int | None:
    vals: dict[str, str] = {}
    for i, w in enumerate(launcher):
        name, eq, val = w.partition("=")
        key = name.replace("_", "-")
        if key in ("--nproc-per-node", "--nnodes"):
            vals[key] = val if eq else (launcher[i + 1] if i + 1 < len(launcher) else "")
    try:
        return int(vals["--nproc-per-node"]) * int(vals.get("--nnodes", "1"))
    except (KeyError, ValueError):
        return None
