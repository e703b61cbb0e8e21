"""The Cython intent vectorizer: stable hashes, the plain-Python reference, slots, buffers."""

from __future__ import annotations

import numpy as np
import pytest
from aiproxy._fast.intent import DEFAULT_SLOTS, Vectorizer, poly_hash

from aiproxy.semantic.features import reference_hashes, reference_ids, vectorizer_from_settings

TEXTS = [
    "Hello, World!",
    "",
    "   ...   ",
    "what is the equivalent of, 'life is good' in french",
    "héllo wörld ab a",
    "日本語のテキスト と English",
    "x" * 150,
    "a b c d",
    "I'd like to transfer $100 from checking to savings!!",
    "UPPER lower MiXeD 123abc",
]


def test_known_values_never_change():
    """A shipped model depends on these exact values: changing the hash breaks it."""
    v = Vectorizer(buckets=1 << 20, seed=0)
    assert v.ids("Hello world").tolist()[:8] == [
        814429, 691446, 725579, 105603, 964651, 868407, 189317, 860533]
    assert [hex(x) for x in v.hashes("Hi")] == [
        "0xa06ac729cd22613a", "0x2e4a31b4a9786724", "0xfe682bea8cb43c91", "0x2b36f9ff19edaab7"]
    v42 = Vectorizer(buckets=1000, seed=42)
    assert v42.ids("Hello world").tolist()[:6] == [542, 582, 810, 206, 837, 934]


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("text", TEXTS)
def test_matches_reference(text, seed):
    v = Vectorizer(buckets=100003, seed=seed)
    assert v.hashes(text).tolist() == reference_hashes(text, seed=seed)
    assert v.ids(text).tolist() == reference_ids(text, 100003, seed=seed)
    assert v.ids(text.encode()).tolist() == v.ids(text).tolist()


@pytest.mark.parametrize("cfg", [dict(word_ngrams=1, char_min=2, char_max=2),
                                 dict(word_ngrams=2, char_min=1, char_max=6),
                                 dict(word_ngrams=2, char_min=3, char_max=0),
                                 dict(word_ngrams=3, char_min=3, char_max=5)])
def test_matches_reference_other_settings(cfg):
    v = Vectorizer(buckets=4099, **cfg)
    kw = {"word_ngrams": cfg["word_ngrams"], "char_min": cfg["char_min"] if cfg["char_max"] else 0,
          "char_max": cfg["char_max"]}
    for text in TEXTS:
        assert v.hashes(text).tolist() == reference_hashes(text, **kw), text


def test_features_shape_and_case():
    v = Vectorizer(buckets=1 << 18, char_max=0)
    # two words: 2 unigrams + 1 bigram; ASCII case folds; punctuation separates
    assert len(v.ids("hello world")) == 3
    assert len(Vectorizer(buckets=99, char_max=0, word_ngrams=3).ids("a b c d")) == 4 + 3 + 2
    assert v.ids("HELLO, World").tolist() == v.ids("hello world").tolist()
    assert v.ids("hello world").tolist() != v.ids("world hello").tolist()
    # empty text still gives one (fixed) feature so a model always has input
    assert len(v.ids("")) == 1 and v.ids("").tolist() == v.ids("!!!").tolist()
    # char n-grams over "<ab>": 3-grams "<ab", "ab>", 4-gram "<ab>"
    assert len(Vectorizer(buckets=97, word_ngrams=1, char_min=3, char_max=5).ids("ab")) == 1 + 3


def test_seed_and_buckets_matter():
    a = Vectorizer(buckets=1 << 16, seed=1).ids("book a flight to paris")
    b = Vectorizer(buckets=1 << 16, seed=2).ids("book a flight to paris")
    assert a.tolist() != b.tolist()
    ids = Vectorizer(buckets=7).ids("book a flight to paris")
    assert ids.min() >= 0 and ids.max() < 7 and ids.dtype == np.int64


def test_deterministic_across_instances_and_poly_hash():
    t = "reset my pin please"
    assert Vectorizer(seed=9).hashes(t).tolist() == Vectorizer(seed=9).hashes(t).tolist()
    assert poly_hash(b"abc", 0) == poly_hash(b"abc") != poly_hash(b"abd")


def test_max_features_cap_and_buffers():
    v = Vectorizer(buckets=1000, max_features=16)
    long = "word " * 100
    assert len(v.ids(long)) == 16
    out = np.zeros(8, np.int64)
    n = v.ids_into(long, out)
    assert n == 8 and out.tolist() == v.ids(long)[:8].tolist()
    ids = np.zeros(64, np.int64)
    w = np.zeros(64, np.float32)
    n = Vectorizer(buckets=1000).encode_into("one two three", ids, w)
    assert n == len(Vectorizer(buckets=1000).ids("one two three"))
    assert np.allclose(w[:n], 1.0 / n) and w[:n].sum() == pytest.approx(1.0)
    vs = Vectorizer(buckets=1000, pooling="sqrt")
    n = vs.encode_into("one two three", ids, w)
    assert np.allclose(w[:n], 1.0 / np.sqrt(n))


def test_encode_batch_pads():
    v = Vectorizer(buckets=1000)
    texts = ["short", "a somewhat longer text here"]
    ids = np.full((2, 128), 99, np.int64)
    w = np.full((2, 128), 9, np.float32)
    longest = v.encode_batch(texts, ids, w)
    n0, n1 = len(v.ids(texts[0])), len(v.ids(texts[1]))
    assert longest == max(n0, n1)
    assert ids[0, :n0].tolist() == v.ids(texts[0]).tolist()
    assert (ids[0, n0:] == 0).all() and (w[0, n0:] == 0).all()
    assert w[1, :n1].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        v.encode_batch(["a", "b", "c"], ids, w)


def test_bad_input_types_and_settings():
    v = Vectorizer()
    with pytest.raises(TypeError):
        v.ids(123)
    with pytest.raises(ValueError):
        Vectorizer(word_ngrams=4)
    with pytest.raises(ValueError):
        Vectorizer(char_min=4, char_max=3)
    with pytest.raises(ValueError):
        Vectorizer(dims=16)  # default slots need 32 dims plus text dims
    with pytest.raises(ValueError):
        Vectorizer(pooling="max")


def test_invalid_utf8_never_breaks():
    v = Vectorizer(buckets=1000)
    for raw in (b"\xff\xfe\xfd", b"caf\xc3", b"\xc3\xa9\xc3", b"ok \x80\x80\x80 ok"):
        ids = v.ids(raw)
        assert len(ids) >= 1 and ids.max() < 1000


def test_vector_slots_layout():
    v = Vectorizer()
    assert v.slots == DEFAULT_SLOTS and v.text_start == 32 and v.dims == 128
    only_user = v.vector(None, {"user_id": "u-42"})
    assert np.count_nonzero(only_user) == 1 and np.flatnonzero(only_user)[0] < 4
    only_action = v.vector(None, {"action": "chat.completions"})
    assert 4 <= np.flatnonzero(only_action)[0] < 16
    only_loc = v.vector(None, {"location": ["eu-west", "paris"]})
    assert all(16 <= i < 32 for i in np.flatnonzero(only_loc))
    text = v.vector("book me a flight")
    assert np.flatnonzero(text).min() >= 32
    both = v.vector("book me a flight", {"user_id": 7, "action": "chat", "location": "paris",
                                         "unknown": "ignored"})
    assert both.dtype == np.float32 and both.shape == (128,)
    assert np.linalg.norm(both) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(both, v.vector("book me a flight", {"user_id": 7, "action": "chat",
                                                              "location": "paris"}))
    assert np.linalg.norm(v.vector(None)) == 0.0
    out = np.empty(128, np.float32)
    assert v.vector("x", None, out) is out


def test_custom_slot_layout_and_settings_roundtrip():
    v = Vectorizer(dims=64, slots=(("tenant", 0, 8), ("model", 8, 8)))
    assert v.text_start == 16
    assert 8 <= np.flatnonzero(v.vector(None, {"model": "gpt-4o"}))[0] < 16
    s = v.settings()
    v2 = vectorizer_from_settings(s)
    assert v2.settings() == s
    assert v2.ids("same text").tolist() == v.ids("same text").tolist()
    with pytest.raises(ValueError):
        vectorizer_from_settings({**s, "hash": "md5"})


def test_vocabulary_ids_follow_the_ngrams():
    """With a vocabulary, each word of the text that is in it adds the id buckets + its
    index after the n-gram ids (which stay as without one), pooled on their own."""
    plain = Vectorizer(buckets=1000, seed=7, word_ngrams=3)
    v = Vectorizer(buckets=1000, seed=7, word_ngrams=3, vocabulary=["thank", "you", "ça"])
    text = "Thank YOU, thank you: merci ça va"
    ngrams = plain.ids(text).tolist()
    assert v.ids(text).tolist() == ngrams + [1000, 1001, 1000, 1001, 1002]
    ids = np.zeros(256, np.int64)
    w = np.zeros(256, np.float32)
    n = v.encode_into(text, ids, w)
    assert n == len(ngrams) + 5
    assert np.allclose(w[:len(ngrams)], 1 / len(ngrams)) and np.allclose(w[len(ngrams):n], 0.2)
    rows_i = np.zeros((2, 256), np.int64)
    rows_w = np.zeros((2, 256), np.float32)
    assert v.encode_batch([text, "nothing known"], rows_i, rows_w) == n
    assert rows_i[0, :n].tolist() == ids[:n].tolist() and np.allclose(rows_w[0, :n], w[:n])
    assert rows_w[1].sum() == pytest.approx(1.0) and rows_i[1].max() < 1000
    # a small buffer: the n-grams leave 1/16 of it to the vocabulary words
    small = np.zeros(32, np.int64)
    assert v.encode_into(text, small, np.zeros(32, np.float32)) == 32
    assert small[:30].tolist() == ngrams[:30] and small[30:].tolist() == [1000, 1001]
    assert v.ids("").tolist() == plain.ids("").tolist()
    s = v.settings()
    assert s["vocabulary_size"] == 3 and "vocabulary_size" not in plain.settings()
    again = vectorizer_from_settings(s, ["thank", "you", "ça"])
    assert again.ids(text).tolist() == v.ids(text).tolist()
    with pytest.raises(ValueError, match="settings say 3"):
        vectorizer_from_settings(s)
    for bad, match in ((["two words"], "not one token"), (["you", "YOU"], "twice"),
                       ([""], "empty")):
        with pytest.raises(ValueError, match=match):
            Vectorizer(buckets=10, vocabulary=bad)
    v.set_vocabulary(None)
    assert v.ids(text).tolist() == ngrams and v.vocabulary_size == 0
