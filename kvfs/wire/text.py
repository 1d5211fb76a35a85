"""Peer-supplied text made safe for a log line (pure)."""

from __future__ import annotations

MAX_LOGGED = 200  # characters of a peer's string in one log line


def printable(text: object, limit: int = MAX_LOGGED) -> str:
    """`text` with every non-printable character escaped (a newline cannot start a forged log
    line, an escape sequence cannot reach a terminal) and cut to `limit` characters, saying
    how long it was. Printable characters, backslashes included, stay as they are, so text
    escaped once is unchanged by a second pass."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    if len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}... ({len(escaped)} characters)"
