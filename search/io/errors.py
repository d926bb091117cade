"""The one domain error type: bad input that the CLI prints as one line and exits 2 on."""

from __future__ import annotations

import pydantic


class AcesoError(Exception):
    """Bad user input. ``str(err)`` is one line naming the field and the fix."""

    exit_code = 2


def _loc_to_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path


def format_validation_error(err: pydantic.ValidationError, prefix: str = "", names=None) -> str:
    """One line for a pydantic error: ``field.path: message`` (the first error; the count of the others).
    ``names(path)`` gives what the user wrote for a field (a flag, a config key), where the input was not ours."""
    first = err.errors()[0]
    msg = first["msg"]
    for noise in ("Value error, ", "Assertion failed, "):
        if msg.startswith(noise):
            msg = msg[len(noise):]
    path = _loc_to_path(tuple(first["loc"]))
    if names is not None and path:
        path = names(path) or path
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    if first["type"] == "extra_forbidden":
        msg = "unknown field; remove it (check the spelling against docs/plan.schema.json)"
    elif first["type"] == "missing":
        msg = "field required; add it"
    elif first["type"] not in ("value_error", "assertion_error") and "input" in first:
        msg += f" (got {_short_repr(first['input'])})"
    line = f"{path}: {msg}" if path and not msg.startswith(path) else msg
    more = len(err.errors()) - 1
    return line + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")


def _short_repr(value, limit: int = 40) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def as_aceso_error(err: pydantic.ValidationError, prefix: str = "") -> AcesoError:
    return AcesoError(format_validation_error(err, prefix))


def read_json(path, missing: str = "no such file", label: str | None = None, corrupt: str = "not valid JSON"):
    """Parse a JSON file; a missing, unreadable or unparsable file becomes one ``AcesoError`` line starting with
    ``label``. ``NaN``/``Infinity`` are read (the schemas then reject them, naming the field); nesting deeper
    than Python's parser goes (about 1000 levels) is refused."""
    import json

    from search.io.files import read_text

    label = label or str(path)
    text = read_text(path, label=label, missing=missing, corrupt=corrupt)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AcesoError(f"{label}: {corrupt} ({e})") from None
    except RecursionError:
        raise AcesoError(f"{label}: {corrupt} (nested too deeply: arrays or objects about 1000 levels deep)") from None


def did_you_mean(word: str, choices, what: str = "") -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` (case ignored), or ``""``."""
    import difflib

    choices = list(choices)
    lower = {c.lower(): c for c in choices}
    if word.lower() in lower:
        return f"; did you mean {what}{lower[word.lower()]}?"
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f"; did you mean {what}{lower[close[0]]}?" if close else ""
