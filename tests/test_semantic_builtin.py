"""The shipped model (builtin:clinc150): loads in onnxruntime, is self-describing, and on the
CLINC150 validation split (val.jsonl + oos_val.jsonl) reaches the issue's targets.
Also the micro-batcher, on the real model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from aiproxy.semantic.classifier import BUILTINS, Batcher, IntentModel
from aiproxy.semantic.train import load_jsonl, metrics

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "clinc150"
# Issue 6's targets on the validation split: in-scope accuracy at the oos threshold and oos
# recall (the threshold is chosen for recall 0.55, a margin over the target).
ACCURACY_TARGET = 0.935
OOS_RECALL_TARGET = 0.5


@pytest.fixture(scope="module")
def model() -> IntentModel:
    return IntentModel("builtin:clinc150")


def test_builtin_is_packaged_and_small():
    path = BUILTINS["clinc150"]
    assert path.is_file()
    assert path.stat().st_size < 8 * 1024 * 1024


def test_builtin_is_a_folded_ensemble(model):
    """Three n-gram members' logits averaged, plus the word rows of three members trained
    with GloVe vectors, shipped as one table of per-class scores: the graph has a single
    Gather and MatMul whatever the trained width."""
    import onnx

    graph = onnx.load(str(BUILTINS["clinc150"])).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMul") == 1 and ops.count("Gather") == 1
    table = next(t for t in graph.initializer if t.name == "T")
    words = model.features["vocabulary_size"]
    assert list(table.dims) == [model.features["buckets"] + words, len(model.labels)]
    assert model.vectorizer.vocabulary_size == words > 4000
    config = model.training["config"]
    assert config["ensemble"] == 3 and config["fold"] and config["label_smoothing"] == 0.2
    assert config["word_vectors"] == "glove-6b-50d" and config["word_vector_members"] == 3
    assert config["vocab_top"] == 0  # the train split's words only


def test_builtin_metadata(model):
    assert len(model.labels) == 151 and "oos" in model.labels
    assert model.oos_label == "oos" and 0 < model.threshold < 1
    assert model.domains["transfer"] == "banking" and model.domains["oos"] == "oos"
    assert len(model.domain_names) == 10
    t = model.training
    assert t["rows"] == 15100 and t["val_metrics"]["accuracy"] >= ACCURACY_TARGET
    assert any(p.endswith("train.jsonl") for p in t["data"])
    assert not any("test" in Path(p).name for p in t["data"] + t["val"])


def test_builtin_classifies(model):
    d = model.classify("how do i say thank you in italian")
    assert d.label == "translate" and d.domain == "travel" and d.confidence > model.threshold
    assert d.embedding.shape[0] >= 32 and abs(float(np.linalg.norm(d.embedding)) - 1) < 1e-3
    assert model.classify(b"please transfer 300 dollars from checking to savings").label == "transfer"


@pytest.fixture(scope="module")
def val_metrics(model) -> dict:
    if not DATA.is_dir():
        pytest.skip("CLINC150 data not found beside the repo (../shared/data/clinc150)")
    val = load_jsonl([str(DATA / "val.jsonl"), str(DATA / "oos_val.jsonl")])
    pred = []
    for i in range(0, len(val.texts), 64):
        pred += [d.label for d in model.classify_batch(val.texts[i:i + 64])]
    # single calls agree with the batched ones
    for text, label in zip(val.texts[:300], pred[:300], strict=True):
        assert model.classify(text).label == label
    m = metrics(pred, val.labels, "oos")
    assert m["rows"] == 3100 and m["oos_rows"] == 100
    return m


def test_builtin_eval_on_val(model, val_metrics):
    """The eval-on-val test: issue 6's targets, in-scope accuracy at the oos threshold and
    oos recall, and the same figures as training recorded."""
    m = val_metrics
    assert m["oos_recall"] >= OOS_RECALL_TARGET, m
    assert m["accuracy"] >= ACCURACY_TARGET, m
    assert m["accuracy"] == pytest.approx(model.training["val_metrics"]["accuracy"], abs=1e-9)


def test_builtin_word_rows(model):
    """The vocabulary is the train split's words that have a GloVe vector: each gives the
    text one more id (its row of per-class scores) after the n-gram ids; a word outside
    it gives none."""
    buckets = model.features["buckets"]
    ids = model.vectorizer.ids("what is the weather forecast")
    assert (ids >= buckets).sum() == 5 and (ids[-5:] >= buckets).all()
    assert (model.vectorizer.ids("what is the qzxv") >= buckets).sum() == 3
    assert model.classify("what is the weather forecast").label == "weather"


def test_batcher_groups_concurrent_requests(model):
    texts = ["what's my balance", "book a table for two", "how do i say hi in french",
             "set an alarm for 6am", "what is the weather like", "play some jazz",
             "transfer money to mom", "tell me a joke"] * 4
    singles = [model.classify(t) for t in texts]

    async def run(max_batch, max_wait_us):
        b = Batcher(model, max_batch=max_batch, max_wait_us=max_wait_us)
        before = model.runs
        try:
            out = await asyncio.gather(*(b.classify(t) for t in texts))
        finally:
            b.close()
        return out, model.runs - before, b

    out, runs, b = asyncio.run(run(16, 2000))
    assert runs == 2 and b.batches == 2 and b.requests == len(texts)
    for got, want in zip(out, singles, strict=True):
        assert got.label == want.label
        assert got.confidence == pytest.approx(want.confidence, abs=1e-5)
        assert np.allclose(got.embedding, want.embedding, atol=1e-5)

    # max_wait 0: each call runs inline on the loop (no thread hop), so nothing batches
    out, runs, b = asyncio.run(run(64, 0))
    assert runs == len(texts) and b.batches == len(texts)
    assert [d.label for d in out] == [d.label for d in singles]


def test_batcher_without_inline_batches_one_loop_iteration(model):
    texts = ["what's my balance", "book a table for two", "play some jazz"] * 5

    async def run():
        b = Batcher(model, max_batch=8, max_wait_us=0, inline_single=False)
        before = model.runs
        try:
            out = await asyncio.gather(*(b.classify(t) for t in texts))
        finally:
            b.close()
        return out, model.runs - before

    out, runs = asyncio.run(run())
    assert runs == 2  # 15 requests queued in one loop iteration: batches of 8 and 7
    assert [d.label for d in out] == [model.classify(t).label for t in texts]


def test_batcher_propagates_errors(model):
    async def run():
        b = Batcher(model, max_batch=4, max_wait_us=1000)
        try:
            return await asyncio.gather(b.classify("fine"), b.classify(12345),
                                        return_exceptions=True)
        finally:
            b.close()

    res = asyncio.run(run())
    assert isinstance(res[1], TypeError)
    assert res[0].label == model.classify("fine").label


def test_eval_cli_on_builtin(capsys):
    from aiproxy.semantic.cli import main

    if not DATA.is_dir():
        pytest.skip("CLINC150 data not found")
    assert main(["eval", "-m", "builtin:clinc150", "--data", str(DATA / "oos_val.jsonl"),
                 "--latency-rows", "50"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["oos_rows"] == 100 and res["oos_recall"] >= 0.5
