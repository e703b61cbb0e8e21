"""Regular expressions from the config that run on client input, in RE2 (as Envoy does).

Python's `re` backtracks: a pattern such as `([a-z]+)+` takes exponential time on a
short input that almost matches, and a route or guard regex runs on the event loop,
so one request of a few dozen bytes would stall every client of the worker. RE2 runs
in time linear in the input, at the price of a smaller syntax: no backreferences, no
lookahead or lookbehind, no atomic groups or possessive quantifiers. A pattern RE2
does not take is a config error (`problem`), never a fallback to `re`.

Route conditions (path_regex, header regex) match the raw bytes of the request, as
Python's bytes patterns did: RE2 runs in Latin-1 mode, so `.` and `[^/]` match any byte
(a path with a byte that is not UTF-8 cannot slip past `/admin/.*`) and a non-ASCII
character of a pattern is its UTF-8 bytes. Guard rules match text (UTF-8), and their
`\\d`, `\\w` and `\\s` keep the Unicode meaning they had under `re` (`unicode_classes`):
RE2's own are ASCII-only, which would let `ignore\\s+previous` miss a no-break space.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import re2

error = re2.error


def _options(latin1: bool) -> Any:
    opts = re2.Options()
    opts.log_errors = False  # a bad pattern is a config problem, not a line from C++ on stderr
    opts.never_capture = True  # only "does it match" is asked: no group offsets to find
    if latin1:
        opts.encoding = re2.Options.Encoding.LATIN1
    return opts


_BYTES = _options(latin1=True)
_TEXT = _options(latin1=False)

# Python's str classes, spelled in RE2: \d is Unicode decimal digits, \w letters,
# numbers and "_", \s Unicode whitespace (str.isspace: also \v, \x1c-\x1f and NEL).
_SPACE = r"\s\x0b\x1c-\x1f\x{85}\p{Z}"
_OUTSIDE = {"d": r"\p{Nd}", "D": r"\P{Nd}", "w": r"[\p{L}\p{N}_]", "W": r"[^\p{L}\p{N}_]",
            "s": f"[{_SPACE}]", "S": f"[^{_SPACE}]"}
# In a class, \W and \S stay RE2's (ASCII): they then match more, never less.
_INSIDE = {"d": r"\p{Nd}", "D": r"\P{Nd}", "w": r"\p{L}\p{N}_", "s": _SPACE}


def unicode_classes(pattern: str) -> str:
    """The pattern with \\d, \\w, \\s (and \\D, \\W, \\S outside a class) as Python's
    `re` reads them in a str pattern."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt == "Q":  # \Q...\E: literal text
                end = pattern.find("\\E", i + 2)
                end = n if end < 0 else end + 2
                out.append(pattern[i:end])
                i = end
                continue
            table = _INSIDE if in_class else _OUTSIDE
            out.append(table.get(nxt, "\\" + nxt))
            i += 2
            continue
        if in_class:
            if c == "[" and pattern.startswith("[:", i):  # [:alpha:]
                end = pattern.find(":]", i + 2)
                end = n if end < 0 else end + 2
                out.append(pattern[i:end])
                i = end
                continue
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a leading "]" is a literal
                out.append("]")
                i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def compile_bytes(pattern: bytes) -> Any:
    """A route condition: matches bytes, byte by byte. Raises `error`."""
    return re2.compile(pattern, _BYTES)


try:
    _WHOLE = re2._re2.RE2.Anchor.ANCHOR_BOTH
except AttributeError:  # the package's private layer changed: its public fullmatch
    _WHOLE = None


def fullmatcher(pattern: bytes) -> Callable[[bytes], Any]:
    """fullmatch(data): true when the pattern matches all of data, else None (as `re`'s
    fullmatch is tested: `is None`). Per request: the RE2 object's Match is called
    directly, since the `re2` module's fullmatch (its Python layer: pos/endpos clamping, a
    Match object) costs 4.7 us against 0.9 us here. Raises `error`."""
    compiled = compile_bytes(pattern)
    raw = getattr(compiled, "_regexp", None)
    if _WHOLE is None or raw is None:
        return compiled.fullmatch
    match = raw.Match

    def fullmatch(data: bytes) -> bool | None:
        return True if match(_WHOLE, data, 0, len(data))[0][0] >= 0 else None

    return fullmatch


def compile_text(pattern: str) -> Any:
    """A guard rule: matches UTF-8 bytes of text (see `text_bytes`). Raises `error`."""
    return re2.compile(unicode_classes(pattern).encode("utf-8"), _TEXT)


def text_bytes(text: str) -> bytes:
    """Text for `compile_text` patterns: once per request, not once per pattern. A lone
    surrogate becomes "?", which `.` matches, as it matched the surrogate under `re`."""
    return text.encode("utf-8", "replace")


_UNSUPPORTED = (
    ("(?=", "lookahead"), ("(?!", "negative lookahead"), ("(?<=", "lookbehind"),
    ("(?<!", "negative lookbehind"), ("(?P=", "backreference"), ("(?>", "atomic group"),
    ("(?#", "comment group"),
)


def problem(pattern: str | bytes, exc: Exception) -> str:
    """Why RE2 refuses the pattern, for a config error: the unsupported feature named."""
    raw = exc.args[0] if exc.args else exc
    msg = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    text = pattern.decode("utf-8", "replace") if isinstance(pattern, bytes) else pattern
    what = None
    if msg.startswith("invalid perl operator: "):
        for prefix, name in _UNSUPPORTED:
            if prefix in text:
                what = f"{name} {prefix}...) not supported"
                break
        else:
            if msg.startswith("invalid perl operator: (?"):
                what = f"flag or group {msg.rsplit(': ', 1)[1]} not supported"
    elif msg.startswith("invalid escape sequence: \\") and msg[-1:].isdigit():
        what = f"backreference {msg.rsplit(': ', 1)[1]} not supported"
    elif msg == "invalid escape sequence: \\Z":
        what = "\\Z not supported (use \\z for the end of the text)"
    elif msg.startswith("bad repetition operator: ") and msg.endswith(("++", "*+", "?+", "}+")):
        what = f"possessive quantifier {msg.rsplit(': ', 1)[1]} not supported"
    return f"RE2 syntax: {what or msg}"
