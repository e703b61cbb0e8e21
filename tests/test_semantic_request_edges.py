"""Request-path edges of semantic routing, through a real proxy process, real upstreams
(demo HTTP upstreams, a grpcio server) and the shipped model run by the native head and
by onnxruntime."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from tests.grpc_support import GRPC_OPTIONS, InferenceServer, grpc_modules  # noqa: F401
from tests.support import free_port, intent_routes_config

BANK = "how much money is in my checking account"


def _chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


@pytest.mark.parametrize("runtime", ["auto", "onnxruntime"])
def test_text_without_words_routes_without_an_intent(start_proxy, bank_and_general, runtime):
    """A prompt with no word in it (whitespace, punctuation, zero-width or control
    characters) gives the vectorizer nothing but its empty-text feature, on which the
    shipped model says "calculator" at 0.92: it must route as an empty prompt does, with
    no intent, not on that made-up one."""
    proxy = start_proxy(intent_routes_config(*bank_and_general,
                                             f'model = "builtin:clinc150"\n'
                                             f'runtime = "{runtime}"\n'))
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        empty = client.post("/echo", content=_chat(""),
                            headers={"content-type": "application/json"})
        assert empty.status_code == 200
        assert "x-aiproxy-intent" not in empty.json()["headers"]
        for text in [" ", "   \n\t", "?!", "...", "\u200b\u200f", "\x00", "\u3000 \u00a0"]:
            r = client.post("/echo", content=_chat(text),
                            headers={"content-type": "application/json"})
            assert r.status_code == 200, text
            seen = r.json()["headers"]
            assert "x-aiproxy-intent" not in seen, (text, seen.get("x-aiproxy-intent"))
            assert r.headers["x-upstream"] == "general"
        # a text with a word in it is still classified, whatever surrounds the word
        r = client.post("/echo", content=_chat("?? " + BANK + " \u200b!!"),
                        headers={"content-type": "application/json"})
        assert r.json()["headers"]["x-aiproxy-intent"] == "balance"
        assert r.headers["x-upstream"] == "bank"
        # so is a text that is one non-Latin word or emoji
        r = client.post("/echo", content=_chat("\U0001f4b0"),
                        headers={"content-type": "application/json"})
        assert "x-aiproxy-intent" in r.json()["headers"]


GRPC_ROUTES = """
[[routes]]
name = "grpc-bank"
match = {{ path_prefix = "/aiproxy.testing.v1.Predictor/", intent_domain = "banking" }}
cluster = "gbank"

[[routes]]
name = "grpc-other"
match = {{ path_prefix = "/aiproxy.testing.v1.Predictor/" }}
cluster = "gother"
"""


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_grpc_message_routes_as_uncompressed(start_proxy, grpc_modules,  # noqa: F811
                                                        compression):
    """A gRPC client that compresses its messages (grpc-encoding gzip or deflate) gets
    the route the same message gets uncompressed: the first message is decompressed
    (bounded) to be read."""
    pb2, pb2_grpc = grpc_modules
    bank = InferenceServer(pb2, pb2_grpc, "gbank", free_port())
    other = InferenceServer(pb2, pb2_grpc, "gother", free_port())
    try:
        config = f"""
[semantic]
model = "builtin:clinc150"

[[clusters]]
name = "gbank"
endpoints = ["127.0.0.1:{bank.port}"]
protocol = "h2"

[[clusters]]
name = "gother"
endpoints = ["127.0.0.1:{other.port}"]
protocol = "h2"
""" + GRPC_ROUTES.format()
        proxy = start_proxy(config, 'protocols = ["h2c"]')
        # a payload that compresses well: grpcio sends a message compressed only when
        # that makes it smaller
        payload = b"\x00" * 4096
        seen = {}
        for comp in (None, compression):
            with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS,
                                       compression=comp) as channel:
                stub = pb2_grpc.PredictorStub(channel)
                rep = stub.Predict(pb2.PredictRequest(model="m", prompt=BANK,
                                                      payload=payload), timeout=10)
                assert rep.count == len(payload)
                seen[comp] = rep.model
                # streamed calls are routed on their first message the same way
                up = stub.Upload(iter([pb2.PredictRequest(prompt=BANK, payload=payload),
                                       pb2.PredictRequest(prompt="x")]), timeout=10)
                assert up.count == 2
                seen[(comp, "upload")] = up.model
        assert seen[None] == "gbank:m"
        assert seen[compression] == "gbank:m"
        assert seen[(None, "upload")] == seen[(compression, "upload")] == "gbank"
    finally:
        bank.stop()
        other.stop()


def _log_records(log, n: int) -> list[dict]:
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.02)
    raise AssertionError(f"expected {n} access log lines, got {lines}")


def test_access_log_says_why_there_is_no_intent(start_proxy, bank_and_general, tmp_path):
    """A request semantic routing looked at and made no intent for has no_intent in its
    access log line, saying why: nothing readable, text without a word, a coded body, a
    body not held (a streamed one no intent route could take). With an intent there is
    none."""
    import gzip

    log = tmp_path / "access.log"
    proxy = start_proxy(intent_routes_config(*bank_and_general, 'model = "builtin:clinc150"')
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n')
    json_type = {"content-type": "application/json"}

    def chunks():
        yield _chat(BANK)

    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        sent = [
            (client.get("/echo/get"), "no_text"),
            (client.post("/echo/empty", content=_chat(""), headers=json_type), "no_text"),
            (client.post("/echo/words", content=_chat("?! ..."), headers=json_type), "no_words"),
            (client.post("/echo/gzip", content=gzip.compress(_chat(BANK)),
                         headers={**json_type, "content-encoding": "gzip"}), "compressed"),
            (client.post("/other", content=chunks(), headers=json_type), "not_held"),
            (client.post("/echo/bank", content=_chat(BANK), headers=json_type), None),
            (client.get("/echo/header", headers={"x-model-intent": "balance"}), None),
        ]
    for r, _ in sent:  # (the demo upstream has no /other: its 404)
        assert r.status_code == (404 if r.request.url.path == "/other" else 200), r.text
    records = {rec["path"]: rec for rec in _log_records(log, len(sent))}
    for r, why in sent:
        rec = records[r.request.url.path]
        assert rec.get("no_intent") == why, rec
        assert (rec["intent"] is None) == (why is not None), rec


def _pb_string(field: int, text: bytes) -> bytes:
    """One length-delimited protobuf field."""
    n, length = len(text), b""
    while True:
        length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return bytes([field << 3 | 2]) + length + text


def _grpc_frame(message: bytes, compress: bool) -> bytes:
    import gzip

    payload = gzip.compress(message) if compress else message
    return bytes([int(compress)]) + len(payload).to_bytes(4, "big") + payload


def test_compressed_grpc_body_is_read_no_further_than_inspect_bytes(start_proxy,
                                                                    bank_and_general):
    """Compressed gRPC messages are read decoded, but no further than the same messages
    uncompressed would be: inspect_bytes in all. Text past that is not read, and a small
    body of well-compressed messages (4 KiB that decode to 1 MiB each) costs what
    inspect_bytes of plain messages cost, not seconds of the event loop."""
    proxy = start_proxy(intent_routes_config(*bank_and_general,
                                             'model = "builtin:clinc150"\n'
                                             'inspect_bytes = 4096\n'))
    filler = _pb_string(1, b" " * 6000)  # text without a word, past inspect_bytes
    one = filler + _pb_string(2, BANK.encode())
    bodies = {
        "one message": (_grpc_frame(one, False), _grpc_frame(one, True)),
        "two messages": (_grpc_frame(filler, False) + _grpc_frame(_pb_string(2, BANK.encode()),
                                                                False),
                         _grpc_frame(filler, True) + _grpc_frame(_pb_string(2, BANK.encode()),
                                                                 True)),
    }
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        # the route the bank text alone gets
        alone = client.post("/echo", content=_grpc_frame(_pb_string(2, BANK.encode()), True),
                            headers={"content-type": "application/grpc"})
        assert alone.headers["x-upstream"] == "bank"
        for name, (plain, packed) in bodies.items():
            assert len(packed) < 4096 < len(plain), name
            seen = {}
            for label, body in (("plain", plain), ("compressed", packed)):
                r = client.post("/echo", content=body,
                                headers={"content-type": "application/grpc"})
                assert r.status_code == 200, (name, label, r.text)
                seen[label] = (r.headers["x-upstream"],
                               r.json()["headers"].get("x-aiproxy-intent"))
            assert seen["plain"] == ("general", None), (name, seen)
            assert seen["compressed"] == seen["plain"], (name, seen)
