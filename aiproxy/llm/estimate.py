"""The token estimator used when an upstream reports no usage (and for reservations).

Deterministic and tokenizer-free: ceil(UTF-8 bytes / 4), the usual rule of thumb for
BPE vocabularies on English text (OpenAI documents "about 4 characters per token"),
plus 4 tokens per chat message for the role and separators the chat format adds.
Every count it produces is labelled as an estimate wherever it is reported.
"""

from __future__ import annotations

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD = 4


def tokens_of_bytes(n: int) -> int:
    """Estimated tokens of n bytes of UTF-8 text."""
    return (n + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN


def tokens_of_text(text: str) -> int:
    return tokens_of_bytes(len(text.encode("utf-8", "surrogatepass")))  # a JSON \ud800
