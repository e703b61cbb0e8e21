"""Semantic routing costs (pytest-benchmark): `pytest bench/bench_semantic.py --benchmark-only`.

Targets from issue 6: feature ids of a 200-byte prompt <= 2 us; one classification
(vectorize + onnxruntime run) p50 <= 30 us on the 2-core dev machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from aiproxy._fast.intent import Vectorizer

from aiproxy.semantic.classifier import Batcher, IntentModel
from aiproxy.semantic.unified import extract

PROMPT_200 = ("Please summarise the following quarterly report and tell me which region grew "
              "fastest, then draft a short email to the sales team about it. Keep it friendly "
              "and under 120 words, thanks! Also list the top three risks.")[:200]
assert len(PROMPT_200.encode()) == 200

SHORT = "how do i transfer money to my savings account"


@pytest.fixture(scope="module")
def model() -> IntentModel:
    return IntentModel("builtin:clinc150")


@pytest.fixture(scope="module")
def vec(model) -> Vectorizer:
    return model.vectorizer


def test_vectorize_ids_200_bytes(benchmark, vec):
    buf = np.empty(vec.max_features, np.int64)
    n = benchmark(vec.ids_into, PROMPT_200, buf)
    assert n > 100


def test_vectorize_ids_200_bytes_utf8(benchmark, vec):
    buf = np.empty(vec.max_features, np.int64)
    data = PROMPT_200.encode()
    benchmark(vec.ids_into, data, buf)


def test_vectorize_encode_with_weights_short(benchmark, vec):
    ids = np.empty(vec.max_features, np.int64)
    w = np.empty(vec.max_features, np.float32)
    benchmark(vec.encode_into, SHORT, ids, w)


def test_dense_vector_with_slots(benchmark, vec):
    out = np.empty(128, np.float32)
    slots = {"user_id": "u-1234", "action": "chat.completions", "location": "eu-west-1"}
    benchmark(vec.vector, PROMPT_200, slots, out)


def test_classify_single_short(benchmark, model):
    d = benchmark(model.classify, SHORT)
    assert d.label == "transfer"


def test_classify_single_200_bytes(benchmark, model):
    benchmark(model.classify, PROMPT_200)


VAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "clinc150" / "val.jsonl"


def test_classify_single_val_rows(benchmark, model):
    """One classification per call, cycling through CLINC150 validation texts (the mix of
    lengths the accuracy numbers are about; `aiproxy router eval` reports their p50)."""
    if not VAL.is_file():
        pytest.skip("CLINC150 data not found beside the repo")
    rows = [json.loads(line)["text"] for line in VAL.read_text().splitlines()[::10]]
    texts = itertools.cycle(rows)
    benchmark(lambda: model.classify(next(texts)))


def test_classify_batch_32(benchmark, model):
    texts = [SHORT, PROMPT_200, "what's the weather in paris", "book a table for 4"] * 8
    out = benchmark(model.classify_batch, texts)
    assert len(out) == 32


def test_batcher_32_concurrent(benchmark, model):
    texts = [SHORT, "what's the weather in paris", "book a table for 4", "play jazz"] * 8

    async def burst(b):
        return await asyncio.gather(*(b.classify(t) for t in texts))

    loop = asyncio.new_event_loop()
    b = Batcher(model, max_batch=32, max_wait_us=100)
    try:
        out = benchmark(lambda: loop.run_until_complete(burst(b)))
    finally:
        b.close()
        loop.close()
    assert len(out) == 32


def test_extract_openai_json(benchmark):
    body = json.dumps({"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": PROMPT_200}]}).encode()
    r = benchmark(extract, b"application/json", body, b"")
    assert r.text == PROMPT_200
