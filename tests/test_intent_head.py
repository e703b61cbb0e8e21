"""LinearHead (the trainer's graph in C) against onnxruntime running the same file.

Every validation text of CLINC150, in scope and out of scope: the same label, the same
top 3 in the same order, probabilities and embedding equal to float32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from aiproxy._fast.intent_head import DecisionLines, LinearHead, confidence_text

from aiproxy.semantic.classifier import IntentModel, native_head

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "clinc150"


def _texts() -> list[str]:
    if not DATA.is_dir():
        pytest.skip(f"CLINC150 data not found at {DATA}")
    return [json.loads(line)["text"] for name in ("val.jsonl", "oos_val.jsonl")
            for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def models() -> tuple[IntentModel, IntentModel]:
    native, session = IntentModel(), IntentModel(native=False)
    assert native.native is not None, "the builtin model's graph was not recognised"
    assert native.native.vectorizer is native.vectorizer  # classify() runs all in C
    assert session.native is None
    return native, session


def test_native_head_matches_onnxruntime_on_val(models):
    native, session = models
    texts = _texts()
    bound, native._bound = native._bound, None
    run, native._run = native._run, None
    sess, native.session = native.session, None  # a fall-back to the session would fail
    try:
        assert len(texts) > 3000
        worst_p = worst_e = 0.0
        for text in texts:
            got, want = native.classify(text), session.classify(text)
            assert got.label == want.label, text
            assert [lab for lab, _ in got.top] == [lab for lab, _ in want.top], text
            assert got.domain == want.domain
            pairs = zip(got.top, want.top, strict=True)
            worst_p = max(worst_p, max(abs(p - q) for (_, p), (_, q) in pairs))
            worst_e = max(worst_e, float(np.abs(got.embedding - want.embedding).max()))
            assert got.embedding.dtype == np.float32
        assert worst_p < 1e-5 and worst_e < 1e-5
    finally:
        native._bound, native._run, native.session = bound, run, sess


def test_batches_still_run_in_the_session(models):
    native, session = models
    got = native.classify_batch(["transfer 100 dollars to my savings", "play some jazz"])
    want = [session.classify(t) for t in ("transfer 100 dollars to my savings",
                                          "play some jazz")]
    assert [d.label for d in got] == [d.label for d in want]


def test_other_graphs_are_left_to_onnxruntime(tmp_path):
    import onnx

    model = onnx.load(str(IntentModel().path))
    model.graph.node[4].attribute[0].i = 0  # Softmax over another axis: not ours
    path = tmp_path / "changed.onnx"
    onnx.save(model, str(path))
    assert native_head(path, 151) is None


def test_bad_inputs_are_refused():
    table = np.arange(12, dtype=np.int8).reshape(4, 3)
    with pytest.raises(ValueError):
        LinearHead(np.zeros((4, 0), np.int8), np.ones(0, np.float32))
    head = LinearHead(table, np.ones(3, np.float32))
    with pytest.raises(TypeError):
        head.__init__(table, np.ones(3, np.float32))  # no second set of buffers
    with pytest.raises(ValueError):
        head.run(1, 1)  # nothing bound
    ids, w = np.array([0, 7], np.int64), np.ones(2, np.float32)
    head.bind(ids, w)
    with pytest.raises(IndexError):
        head.run(2, 1)  # id 7 is not a row
    with pytest.raises(ValueError):
        head.run(3, 1)
    with pytest.raises(ValueError):
        head.run(1, 4)
    top_p, top_i, emb = head.run(1, 3)  # row 0 = [0, 1, 2]
    assert top_i == [2, 1, 0]
    e = np.exp(np.array([0, 1, 2], np.float32) - 2)
    assert np.allclose(top_p, (e / e.sum())[::-1])
    assert np.allclose(emb, np.array([0, 1, 2]) / np.sqrt(5))


@pytest.mark.parametrize("classes", [1, 15, 16, 17, 151, 161, 200, 321])
def test_both_bags_match_numpy(classes):
    """The AVX2 bag (where the CPU has it) and the portable one against float64 numpy:
    widths around the 16-column padding and past the 160 columns held in registers, runs
    of one weight longer than the 256 rows an int16 sum holds, at the int8 extremes."""
    rng = np.random.default_rng(classes)
    rows = 50
    table = rng.integers(-128, 128, size=(rows, classes), dtype=np.int8)
    table[0] = -128
    table[1] = 127
    scale = rng.uniform(0.5, 2.0, classes).astype(np.float32)
    n = 700
    ids = rng.integers(0, rows, n).astype(np.int64)
    ids[:300] = 0  # 300 rows of -128 with one weight: past an int16 sum's reach
    ids[300:600] = 1  # and of 127
    w = np.empty(n, np.float32)
    w[:300], w[300:600] = 0.001, 0.002
    w[600:] = rng.choice(np.float32([0.01, 0.02, 0.5]), n - 600)
    logits = (table[ids].astype(np.float64) * w[:, None]).sum(0) * scale
    k = min(3, classes)
    want_i = sorted(range(classes), key=lambda c: (-logits[c], c))[:k]
    e = np.exp(logits - logits.max())
    for portable in (False, True):
        head = LinearHead(table, scale, portable=portable)
        head.bind(ids, w)
        top_p, top_i, emb = head.run(n, k)
        assert top_i == want_i, portable
        assert np.allclose(top_p, (e / e.sum())[want_i], rtol=1e-5, atol=1e-7)
        assert np.allclose(emb, logits / np.linalg.norm(logits), rtol=1e-4, atol=1e-6)


def test_decide_names_the_classes_and_applies_the_threshold():
    table = np.array([[0, 1, 2], [3, 0, 0]], np.int8)
    head = LinearHead(table, np.ones(3, np.float32))
    ids, w = np.array([0, 1], np.int64), np.ones(2, np.float32)
    head.bind(ids, w)
    with pytest.raises(ValueError):
        head.decide(1, 2, 0.0)  # no labels yet
    with pytest.raises(ValueError):
        head.classify("some text", 2, 0.0)  # no vectorizer bound
    with pytest.raises(ValueError):
        head.name(["a", "b"], ["x", "y"], "oos", "none")
    head.name(["a", "b", "c"], ["x", "y", "z"], "oos", "none")
    top_p, top_i, emb = head.run(1, 2)
    d = head.decide(1, 2, 0.0)
    assert (d.label, d.domain) == ("c", "z")
    assert d.top == [("c", top_p[0]), ("b", top_p[1])] and d.confidence == top_p[0]
    assert np.array_equal(d.embedding, emb)
    low = head.decide(1, 2, 0.99)
    assert (low.label, low.domain, low.top) == ("oos", "none", d.top)
    # top and the embedding are built when read, from the Decision's own copy of the
    # logits: a later decision reusing the head's buffers does not change them
    first = head.decide(1, 2, 0.0)
    head.decide(2, 2, 0.0)
    assert first.top == d.top and np.array_equal(first.embedding, emb)
    assert first.embedding is first.embedding
    assert head.decide(2, 1, 0.0).label == "a"  # rows 0 + 1 = [3, 1, 2]
    assert d.as_dict() == {"label": "c", "confidence": round(top_p[0], 6), "domain": "z",
                           "top": [["c", round(top_p[0], 6)], ["b", round(top_p[1], 6)]]}
    assert repr(d).startswith("Decision(label='c'")


@pytest.mark.parametrize("row, want", [([1, 1, 0, 0], [0, 1, 2]), ([0, 1, 1, 1], [1, 2, 3]),
                                       ([2, 0, 2, 2], [0, 2, 3]), ([0, 0, 0, 0], [0, 1, 2])])
def test_ties_go_to_the_lower_index(row, want):
    """As onnxruntime's TopK: equal logits are ranked by class index."""
    head = LinearHead(np.array([row], np.int8), np.ones(len(row), np.float32))
    head.bind(np.zeros(1, np.int64), np.ones(1, np.float32))
    assert head.run(1, 3)[1] == want


def test_confidence_text_is_what_percent_4f_gives():
    rng = np.random.default_rng(7)
    probs = rng.random(20000, dtype=np.float32)
    # ties at the fourth decimal, as exact as float32 gets, and the ends
    ties = (np.arange(0, 10001, dtype=np.float64) + 0.5) / 10000
    for p in [*probs.tolist(), *ties.astype(np.float32).tolist(), *ties.tolist(), 0.0, 1.0]:
        assert confidence_text(p) == b"%.4f" % p, p
    for odd in (-0.5, 1.5, float("nan"), float("inf")):  # not a probability: formatted
        assert confidence_text(odd) == b"%.4f" % odd


def test_decision_lines_are_the_fields_upstream():
    lines = DecisionLines(limit=2)
    for intent, domain, conf in [("balance", "banking", 0.93125), ("balance", "banking", 1.0),
                                 ("oos", None, 0.00005), ("caf\u00e9", "", 0.5),
                                 ("x" * 300, "d", 0.12345678), ("balance", "banking", 0.0)]:
        want = b"x-aiproxy-intent: " + intent.encode() + b"\r\n"
        if domain:
            want += b"x-aiproxy-intent-domain: " + domain.encode() + b"\r\n"
        want += b"x-aiproxy-intent-confidence: %.4f\r\n" % conf
        assert lines(intent, domain, conf) == want
    # an HTTP/2 upstream gets the same values as fields
    from aiproxy.semantic.router import SemanticRouter

    assert SemanticRouter.decision_fields("balance", "banking", 0.93125) == [
        (b"x-aiproxy-intent", b"balance"), (b"x-aiproxy-intent-confidence", b"0.9313"),
        (b"x-aiproxy-intent-domain", b"banking")]
    assert SemanticRouter.decision_fields("oos", None, 1.0)[-1] == (
        b"x-aiproxy-intent-confidence", b"1.0000")
