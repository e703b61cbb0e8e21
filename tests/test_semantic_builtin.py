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
# Issue 6's targets on the validation split. The shipped model meets the oos recall target;
# its in-scope accuracy (93.33%) is short of 93.5% (see test_builtin_reaches_accuracy_target),
# so ACCURACY_FLOOR guards what it does reach against regressions.
ACCURACY_TARGET = 0.935
ACCURACY_FLOOR = 0.93
OOS_RECALL_TARGET = 0.5


@pytest.fixture(scope="module")
def model() -> IntentModel:
    return IntentModel("builtin:clinc150")


def test_builtin_is_packaged_and_small():
    path = BUILTINS["clinc150"]
    assert path.is_file()
    assert path.stat().st_size < 8 * 1024 * 1024


def test_builtin_is_a_folded_ensemble(model):
    """Three members' logits averaged, shipped as one table of per-class scores: the graph
    has a single MatMul whatever the trained width."""
    import onnx

    graph = onnx.load(str(BUILTINS["clinc150"])).graph
    assert [n.op_type for n in graph.node].count("MatMul") == 1
    table = next(t for t in graph.initializer if t.name == "T")
    assert list(table.dims) == [model.features["buckets"], len(model.labels)]
    config = model.training["config"]
    assert config["ensemble"] == 3 and config["fold"] and config["label_smoothing"] == 0.2


def test_builtin_metadata(model):
    assert len(model.labels) == 151 and "oos" in model.labels
    assert model.oos_label == "oos" and 0 < model.threshold < 1
    assert model.domains["transfer"] == "banking" and model.domains["oos"] == "oos"
    assert len(model.domain_names) == 10
    t = model.training
    assert t["rows"] == 15100 and t["val_metrics"]["accuracy"] >= ACCURACY_FLOOR
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
    """The eval-on-val test: oos recall target met, accuracy at least what was shipped."""
    m = val_metrics
    assert m["oos_recall"] >= OOS_RECALL_TARGET, m
    assert m["accuracy"] >= ACCURACY_FLOOR, m
    assert m["accuracy"] == pytest.approx(model.training["val_metrics"]["accuracy"], abs=1e-9)


@pytest.mark.xfail(strict=True, reason="issue 6 target not reached yet: the hashed n-gram "
                   "linear model (16,384 buckets, 3 members, label smoothing 0.2) reaches "
                   "93.33% in-scope accuracy on val at oos recall 0.55 (93.53% with no oos "
                   "threshold); 93.5% asked. Ensembles of 2-5 members, 8k-32k buckets, char "
                   "2-5-grams, dropout 0.5 and IDF pooling weights all stay at 93.0-93.5%; "
                   "frozen GloVe 50d word features reach 93.67% argmax but 93.20-93.30% at "
                   "the threshold; GloVe-neighbour augmentation, dim 256, sqrt pooling, "
                   "oos rows x3 and other oos scores (temperature, energy, max logit, margin) "
                   "do no better, and seeds 2 and 3 of the recipe give 92.77% and 93.23% "
                   "(README, Semantic routing)")
def test_builtin_reaches_accuracy_target(val_metrics):
    assert val_metrics["accuracy"] >= ACCURACY_TARGET, val_metrics


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
