"""Split a bash script into words and operators as bash's parser does, without expanding or running anything.

A word is a list of parts, each ``(kind, value, quoted)``: ``lit`` text, ``var`` (a ``$NAME`` / ``${...}``
expansion: the text between the braces), ``cmd`` (a command substitution ``$(...)`` / backquotes: its text),
``proc`` (a process substitution ``<(...)`` / ``>(...)``, bash's ``/dev/fd/N``: its text), ``arith`` (``$((...))``:
its text) and ``array`` (the element words of ``NAME=( ... )``). Quoting follows bash:
single quotes are literal, double quotes keep ``$`` expansions and may span lines, a backslash escapes one
character, ``\\<newline>`` joins lines, ``#`` at the start of a word starts a comment. Operators: newline, ``;``,
``&&``, ``||``, ``|``, ``&``, ``(``, ``)``; redirections (``> file``, ``2>&1``, ``&> file``) are dropped with their
target. A here-document (``<<``) is refused with its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from search.io.errors import AcesoError

_NAME_EQ = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=$")
_OPS = ("&&", "||", ";;", ";", "|", "&", "(", ")", "\n")


@dataclass
class Word:
    parts: list[tuple[str, object, bool]]
    line: int

    def literal(self) -> str | None:
        """The text when the word has no expansion (quotes removed), else None."""
        if all(k == "lit" for k, _, _ in self.parts):
            return "".join(v for _, v, _ in self.parts)
        return None

    def unquoted_literal(self) -> str | None:
        """The text when the word is plain unquoted text (a keyword such as ``if`` or ``then``)."""
        if len(self.parts) == 1 and self.parts[0][0] == "lit" and not self.parts[0][2]:
            return self.parts[0][1]
        return None

    def source(self) -> str:
        """A readable rendering for messages."""
        out = []
        for k, v, _ in self.parts:
            out.append({"lit": lambda x: x, "var": lambda x: "${" + x + "}", "cmd": lambda x: "$(" + x + ")",
                        "arith": lambda x: "$((" + x + "))", "array": lambda x: "(...)", "proc": lambda x: x}[k](v))
        return "".join(out)


@dataclass
class Op:
    op: str
    line: int


class Lexer:
    def __init__(self, text: str, source: str):
        self.s, self.i, self.line, self.source = text, 0, 1, source

    def fail(self, what: str):
        raise AcesoError(f"{self.source}: line {self.line}: {what}")

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def take(self, n: int = 1) -> str:
        t = self.s[self.i:self.i + n]
        self.line += t.count("\n")
        self.i += n
        return t

    def tokens(self) -> list[Word | Op]:
        out: list[Word | Op] = []
        while True:
            tok = self.next_token()
            if tok is None:
                return out
            out.append(tok)

    def heredoc(self) -> Word | Op | None:
        """A quoted here-document (``cat > FILE <<'EOF'``: a file the script writes, the way ``aceso export``
        writes a --te-precision-config-file): its body is skipped, as the redirection targets are; an unquoted one
        (its body expanded by the shell) is refused."""
        m = re.match(r"<<-?'(\w+)'", self.s[self.i:])
        if not m:
            self.fail("a here-document (<<) other than a quoted one (<<'EOF'): aceso reads a launch script "
                      "without running it; write the arguments out")
        self.take(len(m.group(0)))
        eol = self.s.find("\n", self.i)
        end = re.compile(r"^" + m.group(1) + r"[ \t]*$", re.M).search(self.s, eol + 1 if eol >= 0 else len(self.s))
        if eol < 0 or end is None:
            self.fail(f"a here-document without its closing {m.group(1)} line")
        body_lines = self.s.count("\n", eol + 1, end.end())
        self.s = self.s[:eol + 1] + self.s[end.end() + 1:]
        self.line += body_lines + 1        # (counted now: the lines after keep their numbers)
        return self.next_token()

    def next_token(self) -> Word | Op | None:
        while True:
            c = self.peek()
            if c == "":
                return None
            if c in " \t\r":
                self.take()
            elif c == "\\" and self.peek(1) == "\n":
                self.take(2)
            elif c == "#":
                while self.peek() not in ("", "\n"):
                    self.take()
            else:
                break
        if self.s.startswith(("<(", ">("), self.i):     # a process substitution is a word (done < <(cmd))
            return self.word()
        if self.s.startswith("<<", self.i):
            return self.heredoc()
        m = re.match(r"(\d*>>?|&>|\d*<)(&\d+|&-)?", self.s[self.i:])
        if m and m.group(0):
            self.take(len(m.group(0)))
            if not m.group(2):                      # a file target follows: drop it
                while self.peek() and self.peek() in " \t":
                    self.take()
                target = self.word()
                if target is None:
                    self.fail("a redirection without a target")
            return self.next_token()
        for op in _OPS:
            if self.s.startswith(op, self.i):
                line = self.line
                self.take(len(op))
                return Op(op, line)
        return self.word()

    def word(self) -> Word | None:
        line, parts = self.line, []
        while True:
            c = self.peek()
            if c in "<>" and self.peek(1) == "(":
                self.take(2)
                parts.append(("proc", c + "(" + self.balanced("(", ")", 1), False))
                continue
            if c == "" or c in " \t\r\n;&|()<>":
                if c == "(" and parts and _is_assign_prefix(_merge(parts)):
                    parts = _merge(parts)
                    self.take()
                    parts.append(("array", self.array(), False))
                    continue
                break
            if c == "\\":
                self.take()
                nxt = self.take()
                if nxt != "\n":
                    parts.append(("lit", nxt, True))
            elif c == "'":
                self.take()
                j = self.s.find("'", self.i)
                if j < 0:
                    self.line = line
                    self.fail("a single quote (') is never closed")
                parts.append(("lit", self.take(j - self.i), True))
                self.take()
            elif c == '"':
                self.take()
                parts += self.double_quoted()
            elif c == "$" or c == "`":
                parts.append(self.dollar(False))
            else:
                parts.append(("lit", self.take(), False))
        return Word(_merge(parts), line) if parts else None

    def double_quoted(self) -> list[tuple[str, object, bool]]:
        parts, start = [], self.line
        while True:
            c = self.peek()
            if c == "":
                self.line = start
                self.fail('a double quote (") is never closed')
            if c == '"':
                self.take()
                return parts or [("lit", "", True)]
            if c == "\\" and self.peek(1) and self.peek(1) in '$`"\\\n':
                self.take()
                nxt = self.take()
                if nxt != "\n":
                    parts.append(("lit", nxt, True))
            elif c in "$`":
                parts.append(self.dollar(True))
            else:
                parts.append(("lit", self.take(), True))

    def dollar(self, quoted: bool) -> tuple[str, object, bool]:
        if self.peek() == "`":
            self.take()
            j = self.s.find("`", self.i)
            if j < 0:
                self.fail("a backquote (`) is never closed")
            body = self.take(j - self.i)
            self.take()
            return ("cmd", body, quoted)
        self.take()                                  # the $
        c = self.peek()
        if self.s.startswith("((", self.i):
            self.take(2)
            return ("arith", self.balanced("(", ")", 2)[:-2], quoted)
        if c == "(":
            self.take()
            return ("cmd", self.balanced("(", ")", 1)[:-1], quoted)
        if c == "{":
            self.take()
            return ("var", self.balanced("{", "}", 1)[:-1], quoted)
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-]", self.s[self.i:])
        if not m:
            return ("lit", "$", quoted)
        return ("var", self.take(len(m.group(0))), quoted)

    def balanced(self, open_: str, close: str, depth: int) -> str:
        start = self.i
        quote = None
        while depth:
            c = self.peek()
            if c == "":
                self.fail(f"'{open_}' is never closed with '{close}'")
            if quote:
                quote = None if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c == open_:
                depth += 1
            elif c == close:
                depth -= 1
            self.take()
        return self.s[start:self.i]

    def array(self) -> list[Word]:
        words: list[Word] = []
        while True:
            tok = self.next_token()
            if tok is None:
                self.fail("an array ( ... ) is never closed with ')'")
            if isinstance(tok, Op):
                if tok.op == ")":
                    return words
                if tok.op != "\n":
                    self.fail(f"{tok.op!r} inside an array ( ... )")
                continue
            words.append(tok)


def _is_assign_prefix(parts) -> bool:
    return len(parts) == 1 and parts[0][0] == "lit" and not parts[0][2] and bool(_NAME_EQ.match(parts[0][1]))


def _merge(parts):
    """Adjacent literal characters of the same quoting joined."""
    out: list[tuple[str, object, bool]] = []
    for p in parts:
        if out and p[0] == "lit" and out[-1][0] == "lit" and out[-1][2] == p[2]:
            out[-1] = ("lit", out[-1][1] + p[1], p[2])
        else:
            out.append(p)
    return out
