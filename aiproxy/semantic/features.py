"""Feature settings shared by training, export and the classifier, plus a plain-Python
reference of the Cython vectorizer (`aiproxy._fast.intent`) used by the tests."""

from __future__ import annotations

from typing import Any

from aiproxy._fast.intent import (
    DEFAULT_SLOTS,
    TAG_BIGRAM,
    TAG_CHAR,
    TAG_EMPTY,
    TAG_TRIGRAM,
    TAG_WORD,
    Vectorizer,
)

MASK64 = (1 << 64) - 1
POLY_P = 0x100000001B3
GOLDEN = 0x9E3779B97F4A7C15
HASH_NAME = "poly64+golden+fastrange"

FEATURE_KEYS = ("seed", "buckets", "word_ngrams", "char_ngrams", "max_features", "pooling")


def vectorizer_from_settings(settings: dict[str, Any],
                             vocabulary: list[str] | None = None) -> Vectorizer:
    """A Vectorizer from the `features` dict stored in a model's metadata (and the model's
    vocabulary words, when its settings have a `vocabulary_size`)."""
    size = int(settings.get("vocabulary_size", 0))
    if len(vocabulary or ()) != size:
        raise ValueError(f"vocabulary has {len(vocabulary or ())} words, settings say {size}")
    hash_name = settings.get("hash", HASH_NAME)
    if hash_name != HASH_NAME:
        raise ValueError(f"unknown feature hash {hash_name!r}")
    cmin, cmax = settings.get("char_ngrams", (3, 5))
    return Vectorizer(
        buckets=int(settings["buckets"]),
        seed=int(settings.get("seed", 0)),
        word_ngrams=int(settings.get("word_ngrams", 2)),
        char_min=int(cmin),
        char_max=int(cmax),
        max_features=int(settings.get("max_features", 2048)),
        pooling=str(settings.get("pooling", "mean")),
        dims=int(settings.get("dims", 128)),
        slots=tuple(tuple(s) for s in settings.get("slots", DEFAULT_SLOTS)),
        vocabulary=vocabulary or None,
    )


# ---- reference implementation (slow, for tests and documentation) ----

def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK64
    k ^= k >> 33
    return k


def _fin(x: int) -> int:
    return (x * GOLDEN) & MASK64


def _table(seed: int) -> list[int]:
    return [_fmix64((seed + (c + 1) * GOLDEN) & MASK64) for c in range(256)]


def _poly(tab: list[int], data: bytes) -> int:
    h = 0
    for b in data:
        h = (h * POLY_P + tab[b]) & MASK64
    return h


def _words(text: bytes) -> list[bytes]:
    out, cur = [], bytearray()
    for b in text:
        if b >= 0x80 or 48 <= b <= 57 or 97 <= b <= 122 or 65 <= b <= 90:
            cur.append(b + 32 if 65 <= b <= 90 else b)
        elif cur:
            out.append(bytes(cur))
            cur.clear()
    if cur:
        out.append(bytes(cur))
    return [w[:64] for w in out]


def _starts(w: bytes) -> list[int]:
    return [i for i, b in enumerate(w) if (b & 0xC0) != 0x80]


def reference_hashes(text: str | bytes, seed: int = 0, word_ngrams: int = 2,
                     char_min: int = 3, char_max: int = 5, max_features: int = 2048) -> list[int]:
    """The raw 64-bit feature hashes `Vectorizer.hashes` returns, in the same order."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    tab = _table(seed)
    out: list[int] = []
    prev = prev2 = None
    for w in _words(data):
        hw = _poly(tab, w)
        out.append(_fin(hw ^ TAG_WORD))
        if word_ngrams >= 2 and prev is not None:
            out.append(_fin(((prev * POLY_P + hw) & MASK64) ^ TAG_BIGRAM))
            if word_ngrams >= 3 and prev2 is not None:
                h3 = ((((prev2 * POLY_P + prev) & MASK64) * POLY_P) + hw) & MASK64
                out.append(_fin(h3 ^ TAG_TRIGRAM))
        prev2, prev = prev, hw
        if char_max:
            m = b"<" + w + b">"
            bounds = _starts(m) + [len(m)]
            for si in range(len(bounds) - 1):
                for n in range(char_min, char_max + 1):
                    if si + n < len(bounds):
                        out.append(_fin(_poly(tab, m[bounds[si]:bounds[si + n]]) ^ TAG_CHAR))
    if not out:
        out.append(_fin(_fmix64(seed ^ GOLDEN) ^ TAG_EMPTY))
    return out[:max_features]


def reference_ids(text: str | bytes, buckets: int, **kw: Any) -> list[int]:
    return [(h * buckets) >> 64 for h in reference_hashes(text, **kw)]
