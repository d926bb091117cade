"""Read a Megatron-LM launch script (or a bare argument line) as bash would, without running anything: the
arguments of its ``pretrain_*.py`` call and the world size of its launcher.

Words and quoting are ``shell_lex``'s. Expansion follows bash: ``NAME=v``, ``export``/``declare``/``local``,
arrays ``NAME=( ... )`` and appends ``NAME+=( ... )`` / ``NAME+=v``, ``$NAME``, ``${NAME}``, ``${NAME:-d}``
(``-``, ``:=``, ``:+``), ``${NAME[@]}`` / ``${NAME[*]}`` / ``${NAME[i]}``, ``${#NAME}``, ``$((...))`` integer
arithmetic; unquoted expansions split into words, ``"${ARR[@]}"`` gives one word per element. The script runs
with no arguments (``$1`` is unset, ``$@`` empty). ``if``/``elif``/``else`` and ``&&``/``||`` are followed when
the test can be decided from the file (``[ ]``/``[[ ]]`` string and integer tests; a variable the file does not
set reads as empty, as with an empty environment, and is noted); a test that cannot (a file
test, a command's status) is only allowed around commands that change nothing aceso reads (``echo``, ``exit``), and
so are ``for`` / ``while`` / ``until`` loops (skipped, noted). A process substitution ``<(cmd)`` is a placeholder
word (so ``done < <(cmd)`` redirects from it). Loops that set variables or run the command, ``case``, functions,
``source``, ``eval`` and here-documents are refused with their line. A value the file
does not give (an unset variable, a command substitution ``$(...)``) is kept as a placeholder and reported only
where a plan flag, the entry point or a flag position needs it (``placeholder``).
The command is the last one that runs a ``.py`` file (``torchrun ... pretrain_gpt.py ARGS``, ``python ...``,
``sh -c "..."``); without one the words of the file are the argument list. ``--nproc-per-node`` x ``--nnodes`` of
the launcher is the world size when both are numbers.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

from search.io.errors import AcesoError
from .shell_lex import Lexer, Op, Word

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?=)(.*)$", re.S)
_PARAM = re.compile(r"^(#)?([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:\[(@|\*|-?\d+)\])?(?:(:?[-=+?])(.*))?$",
                    re.S)
_LOOPS = ("select", "case", "function", "coproc")     # refused with their line
_READ_LOOPS = ("for", "while", "until")               # skipped when they change nothing aceso reads
_DECLARE = ("export", "declare", "local", "readonly", "typeset")
_SEPARATORS = ("\n", ";", "&", ";;", "(", ")")


@dataclass
class Command:
    argv: list[str]                       # the entry script's arguments
    script: str | None = None             # e.g. pretrain_gpt.py
    path: str | None = None               # the entry as the file names it, e.g. examples/mimo/train.py
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    assigned: list[str] = field(default_factory=list)   # variables the file sets


def placeholder(value: str) -> str | None:
    """What a value the file does not give stands for, as a phrase for a message; None for a real value."""
    m = re.search(r"<unset:([^>]*)>|<cmd:(.*?)>|<expr:(.*?)>", value, re.S)
    if not m:
        return None
    if m.group(1) is not None:
        name = m.group(1)
        return (f"${name}, the script's argument {name}," if name.isdigit() else f"${name},") + \
            " which the file does not set"
    if m.group(2) is not None:
        return f"the command substitution {m.group(2).replace(chr(0), ' ')}, which aceso cannot expand without running it"
    return f"the expansion {m.group(3).replace(chr(0), ' ')}, which aceso does not expand"


def _hole(kind: str, text: str) -> str:
    """A placeholder for a value the file does not give; NUL for spaces, so word splitting keeps it whole."""
    return f"<{kind}:{text.replace(' ', chr(0))}>"


@dataclass
class _Chain:
    items: list[tuple[list[Word], str | None]]    # (words, the connector before: && || | or None)
    line: int


@dataclass
class _Loop:
    kind: str                                     # for, while, until
    head: list                                    # the condition (while/until) or the word list (for)
    body: list
    line: int


@dataclass
class _If:
    branches: list[tuple[list, list]]             # (condition nodes, body nodes)
    otherwise: list
    line: int


class _Parser:
    def __init__(self, toks: list, source: str):
        self.toks, self.i, self.source = toks, 0, source

    def fail(self, line: int, what: str):
        raise AcesoError(f"{self.source}: line {line}: {what}")

    def parse_list(self, stop: frozenset[str]) -> tuple[list, str | None]:
        nodes: list = []
        while True:
            while self.i < len(self.toks) and isinstance(self.toks[self.i], Op) and \
                    self.toks[self.i].op in _SEPARATORS:
                self.i += 1
            if self.i >= len(self.toks):
                return nodes, None
            tok = self.toks[self.i]
            kw = tok.unquoted_literal() if isinstance(tok, Word) else None
            if kw in stop:
                self.i += 1
                return nodes, kw
            if kw in ("then", "elif", "else", "fi", "do", "done", "esac"):
                self.fail(tok.line, f"'{kw}' without its opening statement")
            if kw == "if":
                self.i += 1
                nodes.append(self.parse_if(tok.line))
            elif kw in _READ_LOOPS:
                self.i += 1
                nodes.append(self.parse_loop(kw, tok.line))
            elif kw in _LOOPS:
                self.fail(tok.line, f"a '{kw}' statement: aceso reads a launch script without running it and "
                                    "does not expand loops, case or functions; write the command out")
            elif kw in ("{", "}", "!"):
                self.i += 1
            else:
                nodes.append(self.parse_chain())

    def parse_chain(self) -> _Chain:
        line = self.toks[self.i].line
        items: list[tuple[list[Word], str | None]] = []
        conn = None
        while True:
            words: list[Word] = []
            while self.i < len(self.toks) and isinstance(self.toks[self.i], Word):
                words.append(self.toks[self.i])
                self.i += 1
            nxt = self.toks[self.i] if self.i < len(self.toks) else None
            if len(words) == 1 and isinstance(nxt, Op) and nxt.op == "(":
                self.fail(line, f"a function definition ({words[0].source()}() ...): aceso does not expand "
                                "functions; write the command out")
            if conn == "|" and words and _pattern_piece(words[0].source()):
                self.fail(line, f"'|' outside quotes pipes the command into {words[0].source()}, a piece of a hybrid "
                                "layer pattern (bash reads it so too); quote the --hybrid-layer-pattern value")
            items.append((words, conn))
            if isinstance(nxt, Op) and nxt.op in ("&&", "||", "|"):
                conn = nxt.op
                self.i += 1
                continue
            return _Chain(items, line)

    def parse_loop(self, kind: str, line: int) -> _Loop:
        head, kw = self.parse_list(frozenset({"do"}))
        if kw != "do":
            self.fail(line, f"a '{kind}' without 'do'")
        body, kw = self.parse_list(frozenset({"done"}))
        if kw != "done":
            self.fail(line, f"a '{kind}' loop never closed with 'done'")
        return _Loop(kind, head, body, line)

    def parse_if(self, line: int) -> _If:
        branches = []
        kw = "elif"
        while kw == "elif":
            cond, kw = self.parse_list(frozenset({"then"}))
            if kw != "then":
                self.fail(line, "an 'if' without 'then'")
            body, kw = self.parse_list(frozenset({"elif", "else", "fi"}))
            branches.append((cond, body))
        otherwise: list = []
        if kw == "else":
            otherwise, kw = self.parse_list(frozenset({"fi"}))
        if kw != "fi":
            self.fail(line, "an 'if' never closed with 'fi'")
        return _If(branches, otherwise, line)


def _pattern_piece(word: str) -> bool:
    """A word made of megatron-core's hybrid layer symbols (``MEMEM*E``, ``M-M-/*E``): what follows an unquoted
    ``|`` of a ``--hybrid-layer-pattern`` value, never a program."""
    from search.layers.hybrid import MEGATRON_SYMBOLS, MTP
    return bool(word) and set(word) <= set(MEGATRON_SYMBOLS + MTP) and bool(set(word) & set("MGDE"))


class _Shell:
    def __init__(self, source: str, env: dict[str, list[str]] | None = None):
        self.source = source
        self.env: dict[str, list[str]] = dict(env or {})
        self.commands: list[tuple[list[str], int]] = []
        self.assigned: list[str] = []
        self.notes: list[str] = []

    def fail(self, line: int, what: str):
        raise AcesoError(f"{self.source}: line {line}: {what}")

    # -- control flow
    def run(self, nodes: list, in_cond: bool = False) -> bool | None:
        status: bool | None = True
        for node in nodes:
            if isinstance(node, _Loop):
                status = self.run_loop(node)
            else:
                status = self.run_if(node) if isinstance(node, _If) else self.run_chain(node, in_cond)
        return status

    def run_loop(self, node: _Loop) -> bool:
        """A loop that only prints (``while read l; do echo "$l"; done < <(cmd)``) is skipped, noted; one that
        sets variables or runs the command is refused with its line."""
        if _consequential(node.head) or _consequential(node.body):
            self.fail(node.line, f"a '{node.kind}' loop that sets variables or runs the command: aceso reads a "
                                 "launch script without running it and does not expand loops; write the command out")
        self.notes.append(f"line {node.line}: skipped a '{node.kind}' loop (it only prints)")
        for name in _loop_variables(node):           # what the loop leaves in them is unknown without running it
            self.env[name] = [_hole("expr", f"${name} (set by the loop on line {node.line})")]
        return True

    def run_if(self, node: _If) -> bool | None:
        for cond, body in node.branches:
            s = self.run(cond, in_cond=True)
            if s is None:
                if any(_consequential(b) for _, b in node.branches) or _consequential(node.otherwise):
                    self.fail(node.line, "an 'if' whose test cannot be decided without running it sets "
                                         "variables or runs the command; write the chosen branch out")
                self.notes.append(f"line {node.line}: skipped an 'if' whose test needs running (it only prints "
                                  "or exits)")
                return True
            if s:
                return self.run(body)
        return self.run(node.otherwise)

    def run_chain(self, chain: _Chain, in_cond: bool) -> bool | None:
        last: bool | None = True
        for words, conn in chain.items:
            if conn in ("&&", "||"):
                if last is None:
                    if _consequential([_Chain([(words, None)], chain.line)]):
                        self.fail(chain.line, f"'{conn}' after a test that cannot be decided without running it")
                    continue
                if (conn == "&&") != last:
                    continue
            last = self.simple(words, in_cond)
        return last

    # -- one simple command
    def simple(self, words: list[Word], in_cond: bool) -> bool | None:
        if not words:
            return True
        first = words[0].unquoted_literal()
        if first in _DECLARE:
            for w in words[1:]:
                if not (w.unquoted_literal() or "").startswith("-"):
                    self.assign(w, strict=False)
            return True
        assigns = []
        while words and _assignment(words[0]):
            assigns.append(words.pop(0))
        if not words:
            for w in assigns:
                self.assign(w)
            return True
        name = words[0].unquoted_literal()
        if name in ("source", "."):
            self.fail(words[0].line, f"'{name} {words[1].source() if len(words) > 1 else ''}' reads another "
                                     "file: aceso reads one launch script without running it; give the script "
                                     "that runs pretrain_gpt.py with its arguments")
        if name == "eval":
            self.fail(words[0].line, "'eval': aceso reads a launch script without running it; write the command "
                                     "out")
        if name == "unset":
            for w in words[1:]:
                self.env.pop(w.literal() or "", None)
            return True
        argv = [x for w in words for x in self.expand(w)]
        if argv and argv[0] in ("[", "[[", "test"):
            unset = sorted({m for a in argv for m in re.findall(r"<unset:([^>]*)>", a)})
            if unset:                                 # as bash runs it with an empty environment
                self.notes.append(f"line {words[0].line}: a test reads {', '.join('$' + u for u in unset)}, "
                                  "which the file does not set: read as empty")
                argv = [re.sub(r"<unset:[^>]*>", "", a) for a in argv]
            return _test(argv)
        if argv and argv[0] in ("true", ":"):
            return True
        if argv and argv[0] == "false":
            return False
        self.command(argv, words[0].line)
        return None if in_cond else True

    def command(self, argv: list[str], line: int):
        for k, w in enumerate(argv[:-2]):
            if w.rsplit("/", 1)[-1] in ("sh", "bash") and argv[k + 1] == "-c" and ".py" in argv[k + 2]:
                holes: list[str] = []                 # placeholders are not shell syntax: kept aside
                text = re.sub(r"<(unset|cmd|expr):[^>]*>", lambda m: holes.append(m.group(0)) or
                              f"__ACESO_HOLE_{len(holes) - 1}__", argv[k + 2])
                inner = _Shell(self.source, self.env)
                inner.run(_parse(text, self.source))
                back = lambda w: re.sub(r"__ACESO_HOLE_(\d+)__", lambda m: holes[int(m.group(1))], w)
                self.commands += [([back(w) for w in a], line) for a, _ in inner.commands]
                return
        self.commands.append((argv, line))

    def assign(self, w: Word, strict: bool = True):
        parts = list(w.parts)
        m = _ASSIGN.match(parts[0][1]) if parts and parts[0][0] == "lit" and not parts[0][2] else None
        if not m:
            if strict:
                self.fail(w.line, f"cannot read the assignment {w.source()!r}")
            return
        name, op = m.group(1), m.group(2)
        rest = Word(([("lit", m.group(3), False)] if m.group(3) else []) + parts[1:], w.line)
        if rest.parts and rest.parts[0][0] == "array":
            vals = [x for e in rest.parts[0][1] for x in self.expand(e)]
        else:
            vals = [" ".join(self.expand(rest, split=False))]      # "${A[@]}" in an assignment: joined by spaces
            if op == "+=":
                old = self.env.get(name, [""])
                vals = [(old[0] if old else "") + vals[0]] + old[1:]
                op = "="
        self.env[name] = (self.env.get(name, []) + vals) if op == "+=" else vals
        self.assigned.append(name)

    # -- expansion
    def expand(self, w: Word, split: bool = True) -> list[str]:
        fields: list[str] = []
        cur: str | None = None
        for kind, v, quoted in w.parts:
            if kind == "lit":
                cur = (cur or "") + v
                continue
            if kind == "var":
                vals, many = self.param(v, w.line)
            elif kind == "arith":
                vals, many = [self.arith(v)], False
            elif kind == "cmd":
                vals, many = [_hole("cmd", f"$({v})")], False
            elif kind == "proc":                     # bash: a /dev/fd/N path to the command's output
                vals, many = [_hole("cmd", v)], False
            else:
                self.fail(w.line, f"an array {w.source()!r} where a word is expected")
            if quoted or not split:
                if many and quoted:
                    for k, x in enumerate(vals):
                        if k:
                            fields.append(cur)
                            cur = x
                        else:
                            cur = (cur or "") + x
                else:
                    cur = (cur or "") + " ".join(vals)
                continue
            text = " ".join(vals)
            pieces = text.split()
            if not pieces:
                continue
            if text[0].isspace() and cur is not None:
                fields.append(cur)
                cur = None
            cur = (cur or "") + pieces[0]
            for p in pieces[1:]:
                fields.append(cur)
                cur = p
            if text[-1].isspace():
                fields.append(cur)
                cur = None
        if cur is not None:
            fields.append(cur)
        return fields

    def param(self, expr: str, line: int) -> tuple[list[str], bool]:
        m = _PARAM.match(expr)
        if not m:
            return [_hole("expr", f"${{{expr}}}")], False
        length, name, index, op, arg = m.groups()
        if name in ("@", "*"):
            return [], name == "@"
        if name == "#":
            return ["0"], False
        if name in ("?", "$", "!", "-"):
            return [_hole("expr", f"${name}")], False
        vals = self.env.get(name)
        if vals is not None and index not in (None, "@", "*"):
            k = int(index)
            vals = [vals[k]] if -len(vals) <= k < len(vals) else None
        elif vals is not None and index is None:
            vals = vals[:1] or [""]
        if length:
            return [str(len(vals or []) if index in ("@", "*") else len((vals or [""])[0]))], False
        empty = vals is None or (op is not None and op.startswith(":") and vals in ([], [""]))
        if op is not None and op.endswith("+"):
            return (self.word_text(arg, line) if not empty else []), False
        if op is not None and op.endswith(("-", "=")) and empty:
            vals = self.word_text(arg, line)
            if op.endswith("="):
                self.env[name] = vals
        if vals is None:
            return [f"<unset:{name}>"], False
        return vals, index == "@"

    def word_text(self, text: str, line: int) -> list[str]:
        """The word of ``${NAME:-word}`` expanded, spaces kept (bash: ``${T:-a b}`` unquoted is two words)."""
        words = [t for t in Lexer(text, self.source).tokens() if isinstance(t, Word)] if text else []
        return [" ".join(" ".join(self.expand(w, split=False)) for w in words)] if words else [""]

    def arith(self, text: str) -> str:
        expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", text)
        try:
            return str(_arith(ast.parse(expr.strip(), mode="eval").body, self.env))
        except (SyntaxError, ValueError, KeyError, ZeroDivisionError, TypeError):
            return _hole("expr", f"$(({text}))")


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.floordiv, ast.Mod: operator.mod}


def _arith(node, env) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return int((env.get(node.id) or ["0"])[0] or 0)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_arith(node.left, env), _arith(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand, env)
    raise ValueError("not integer arithmetic")


def _assignment(w: Word) -> bool:
    p = w.parts[0]
    return p[0] == "lit" and not p[2] and bool(_ASSIGN.match(p[1]))


def _loop_variables(node: _Loop) -> list[str]:
    """The variables a loop sets: a ``for`` loop's name, the names ``read`` fills in a ``while`` / ``until`` head."""
    chains = [n for n in node.head if isinstance(n, _Chain)]
    words = [w.unquoted_literal() or "" for c in chains for ws, _ in c.items for w in ws]
    if node.kind == "for":
        return words[:1] if words and re.match(r"^[A-Za-z_]\w*$", words[0]) else []
    if "read" not in words:
        return []
    return [w for w in words[words.index("read") + 1:] if re.match(r"^[A-Za-z_]\w*$", w)]


def _consequential(nodes: list) -> bool:
    """Whether a block sets a variable, runs a ``.py`` file or reads another file."""
    for node in nodes:
        if isinstance(node, _Loop):
            if _consequential(node.head) or _consequential(node.body):
                return True
            continue
        if isinstance(node, _If):
            if any(_consequential(c) or _consequential(b) for c, b in node.branches) or \
                    _consequential(node.otherwise):
                return True
            continue
        for words, _ in node.items:
            if words and words[0].unquoted_literal() in ("echo", "printf"):
                continue
            if words and (_assignment(words[0]) or words[0].unquoted_literal() in _DECLARE + ("source", ".")):
                return True
            if any(".py" in str(v) for w in words for k, v, _ in w.parts if k in ("lit", "cmd")):
                return True
    return False


def _test(argv: list[str]) -> bool | None:
    """``[ ... ]`` / ``[[ ... ]]`` / ``test ...`` when it can be decided from the text, else None."""
    inner = argv[1:-1] if argv[0] in ("[", "[[") and argv[-1] in ("]", "]]") else argv[1:]
    neg = False
    while inner and inner[0] == "!":
        neg, inner = not neg, inner[1:]
    if any(placeholder(x) for x in inner):
        return None
    r: bool | None = None
    if len(inner) == 1:
        r = inner[0] != ""
    elif len(inner) == 2 and inner[0] in ("-z", "-n"):
        r = (inner[1] == "") == (inner[0] == "-z")
    elif len(inner) == 3 and inner[1] in ("=", "==", "!=") and not re.search(r"[*?\[]", inner[2]):
        r = (inner[0] == inner[2]) == (inner[1] != "!=")
    elif len(inner) == 3 and inner[1] in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
        try:
            a, b = int(inner[0]), int(inner[2])
        except ValueError:
            return None
        r = {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b, "-gt": a > b, "-ge": a >= b}[inner[1]]
    return None if r is None else r != neg


def _parse(text: str, source: str) -> list:
    nodes, kw = _Parser(Lexer(text, source).tokens(), source).parse_list(frozenset())
    return nodes


def read_command(text: str, source: str = "arguments") -> Command:
    from .entry import READ, check_no_entry, harmless

    sh = _Shell(source)
    sh.run(_parse(text, source))
    runs = [(argv, line) for argv, line in sh.commands if any(w.endswith(".py") for w in argv)]
    if not runs:                                  # an argument line, or a file that runs something else
        check_no_entry(sh.commands, source)
        return Command(argv=[x for argv, _ in sh.commands if not harmless(argv) for x in argv], notes=sh.notes,
                       assigned=sh.assigned)
    priced = [r for r in runs if any(w.rsplit("/", 1)[-1] in READ for w in r[0])]
    chosen = priced or runs
    if len({tuple(argv) for argv, _ in chosen}) > 1:
        script = next(w for w in chosen[-1][0] if w.endswith(".py")).rsplit("/", 1)[-1]
        raise AcesoError(f"{source}: runs {script} {len(chosen)} times with different arguments (lines "
                         f"{', '.join(str(line) for _, line in chosen)}); aceso prices one run: keep one command in "
                         "the file, or give that command's arguments with --megatron-args / --args")
    if len(chosen) > 1:
        sh.notes.append(f"the same command runs {len(chosen)} times (lines {', '.join(str(x) for _, x in chosen)}); "
                        "priced once")
    command, _ = chosen[-1]
    k = max(i for i, w in enumerate(command) if w.endswith(".py") and (not priced or w.rsplit("/", 1)[-1] in READ))
    return Command(argv=command[k + 1:], script=command[k].rsplit("/", 1)[-1], path=command[k],
                   world_size=_world_size(command[:k]), notes=sh.notes, assigned=sh.assigned)


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
