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


def format_validation_error(err: pydantic.ValidationError, prefix: str = "") -> str:
    """One line for a pydantic error: ``field.path: message`` (the first error; the count of the others)."""
    first = err.errors()[0]
    msg = first["msg"]
    for noise in ("Value error, ", "Assertion failed, "):
        if msg.startswith(noise):
            msg = msg[len(noise):]
    path = _loc_to_path(tuple(first["loc"]))
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    if first["type"] == "extra_forbidden":
        msg = "unknown field; remove it (check the spelling against docs/plan.schema.json)"
    elif first["type"] == "missing":
        msg = "field required; add it"
    line = f"{path}: {msg}" if path and not msg.startswith(path) else msg
    more = len(err.errors()) - 1
    return line + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")


def as_aceso_error(err: pydantic.ValidationError, prefix: str = "") -> AcesoError:
    return AcesoError(format_validation_error(err, prefix))


def read_json(path, missing: str = "no such file", label: str | None = None, corrupt: str = "not valid JSON"):
    """Parse a JSON file; a missing or unparsable file becomes one ``AcesoError`` line starting with ``label``."""
    import json
    from pathlib import Path

    label = label or str(path)
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise AcesoError(f"{label}: {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AcesoError(f"{label}: {corrupt} ({e})") from None
