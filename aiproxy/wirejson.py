"""JSON from the wire (request and response bodies): json.loads, with every way a
hostile document can fail it reported as ValueError."""

from __future__ import annotations

import json
from typing import Any


def loads(data: bytes | str) -> Any:
    """json.loads (NaN and integers past 64 bits as Python takes them). Raises ValueError
    for anything that is not JSON: invalid UTF-8 (UnicodeDecodeError is one) and a
    document nested deeper than the parser's recursion allows (a RecursionError, which
    would otherwise escape every `except ValueError` and fail the request)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def valid_text(text: str) -> str:
    """`text` with lone surrogates (what a JSON \\ud800 escape decodes to) as U+FFFD, so
    it encodes as UTF-8; a valid surrogate pair becomes its character."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
