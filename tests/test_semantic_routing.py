"""Semantic routing in the proxy: the builtin model picks the route by intent/domain."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import httpx
import pytest

from tests.support import free_port, intent_routes_config


def semantic_config(bank: int, general: int, extra: str = "") -> str:
    return intent_routes_config(bank, general,
                                f'model = "builtin:clinc150"\ninspect_bytes = 4096\n{extra}')


def chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


@pytest.mark.parametrize("runtime", ["auto", "onnxruntime"])
def test_domain_routes_and_headers_upstream(start_proxy, bank_and_general, runtime):
    """Both runtimes (the native head, onnxruntime's session) route alike."""
    admin = free_port()
    proxy = start_proxy(semantic_config(*bank_and_general, f'runtime = "{runtime}"\n')
                        + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n')
    with httpx.Client(base_url=proxy.url) as client:
        r = client.post("/echo", content=chat("how much money is in my checking account"),
                        headers={"content-type": "application/json"})
        assert r.status_code == 200
        assert r.headers["x-upstream"] == "bank"
        seen = r.json()["headers"]
        assert seen["x-aiproxy-intent-domain"] == "banking"
        assert seen["x-aiproxy-intent"] == "balance"
        assert 0 < float(seen["x-aiproxy-intent-confidence"]) <= 1
        r = client.post("/echo", content=chat("what is the weather going to be tomorrow"),
                        headers={"content-type": "application/json"})
        assert r.headers["x-upstream"] == "general"
        # an explicit intent header skips the model
        r = client.post("/echo", content=chat("tell me a joke"),
                        headers={"content-type": "application/json", "x-model-intent": "transfer"})
        assert r.headers["x-upstream"] == "bank"
        assert r.json()["headers"]["x-aiproxy-intent"] == "transfer"
        # the query string counts as text for bodyless requests
        r = client.get("/echo", params={"q": "freeze my bank account right now"})
        assert r.headers["x-upstream"] == "bank"
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert 'aiproxy_semantic_decisions_total{intent_domain="banking"}' in metrics
    assert "aiproxy_semantic_explicit_total 1.0" in metrics
    assert "aiproxy_stage_semantic_classify_seconds_count" in metrics


def test_explicit_intent_is_utf8_both_ways(start_proxy, bank_and_general):
    """A non-ASCII intent in the header matches a route written with it in the config and
    reaches the upstream as the bytes the client sent; one that is not UTF-8 is a 400."""
    bank, general = bank_and_general
    config = semantic_config(bank, general).replace(
        '[[routes]]\nname = "banking"',
        '[[routes]]\nname = "transfer-de"\n'
        'match = { path_prefix = "/echo", intent = "\u00fcberweisung" }\ncluster = "bank"\n\n'
        '[[routes]]\nname = "banking"', 1)
    proxy = start_proxy(config)
    with httpx.Client(base_url=proxy.url) as client:
        r = client.post("/echo", content=chat("tell me a joke"),
                        headers={"content-type": "application/json",
                                 "x-model-intent": "\u00fcberweisung".encode()})
        assert r.status_code == 200
        assert r.headers["x-upstream"] == "bank"
        assert r.json()["headers"]["x-aiproxy-intent"] == "\u00fcberweisung"
        r = client.post("/echo", content=chat("tell me a joke"),
                        headers={"content-type": "application/json",
                                 "x-model-intent": b"\xfcberweisung"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "x-model-intent is not UTF-8"


def test_large_body_streams_untouched(start_proxy, bank_and_general):
    proxy = start_proxy(semantic_config(*bank_and_general))
    prefix = b'{"model": "m", "messages": [{"role": "user", "content": "transfer money to my savings"}], "pad": "'
    body = prefix + b"x" * (8 * 1024 * 1024) + b'"}'

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    r = httpx.post(proxy.url + "/echo", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200
    got = r.json()
    assert got["body_bytes"] == len(body)
    assert got["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert r.headers["x-upstream"] == "bank"


def test_expect_continue_with_inspection(start_proxy, bank_and_general):
    proxy = start_proxy(semantic_config(*bank_and_general))
    out = subprocess.run(
        ["curl", "-s", "-H", "Expect: 100-continue", "-H", "content-type: application/json",
         "--data-binary", chat("how much money is in my checking account").decode(),
         "-D", "-", proxy.url + "/echo"], capture_output=True, timeout=20)
    assert b"100 Continue" in out.stdout
    assert b"x-upstream: bank" in out.stdout.lower()


def test_bad_model_refused(tmp_path):
    port = free_port()
    cfg = tmp_path / "bad.toml"
    missing = tmp_path / "missing.onnx"
    cfg.write_text(f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   f'[semantic]\nmodel = "{missing}"\n[[clusters]]\nname = "c"\nendpoints = []\n')
    check = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(cfg)],
                           capture_output=True, text=True)
    assert check.returncode == 2
    assert "semantic.model: no such model file" in check.stderr
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    cfg.write_text(cfg.read_text().replace(str(missing), str(garbage)))
    run = subprocess.run([sys.executable, "-m", "aiproxy", "-c", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "garbage.onnx" in run.stderr and "cannot load ONNX model" in run.stderr


def test_intent_route_without_semantic_section_is_a_config_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[listeners]]\nname = "l"\naddress = "127.0.0.1:1"\n'
                   '[[clusters]]\nname = "c"\nendpoints = []\n'
                   '[[routes]]\nname = "r"\ncluster = "c"\nmatch = { intent = "transfer" }\n')
    check = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(cfg)],
                           capture_output=True, text=True)
    assert check.returncode == 2
    assert "c.toml:10: routes[0].match.intent: matching on intent needs a [semantic] section" \
        in check.stderr




def test_unknown_runtime_is_a_config_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[listeners]]\nname = "l"\naddress = "127.0.0.1:1"\n'
                   '[semantic]\nruntime = "tensorflow"\n'
                   '[[clusters]]\nname = "c"\nendpoints = []\n')
    check = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(cfg)],
                           capture_output=True, text=True)
    assert check.returncode == 2
    assert "c.toml:5: semantic.runtime: expected \"auto\" or \"onnxruntime\", got " \
        "'tensorflow'" in check.stderr


def test_empty_intent_header_names_no_intent(start_proxy, bank_and_general):
    """An empty intent header names no intent (as an empty field is no value in nginx's
    $http_ variables): the model reads the request as without the header, rather than
    routing it on the intent "" and sending `x-aiproxy-intent: ` at confidence 1."""
    proxy = start_proxy(semantic_config(*bank_and_general))
    with httpx.Client(base_url=proxy.url) as client:
        for value in (b"",):  # (the parser strips whitespace: "   " arrives empty)
            r = client.post("/echo", content=chat("how much money is in my checking account"),
                            headers={"content-type": "application/json",
                                     "x-model-intent": value})
            assert r.status_code == 200
            assert r.headers["x-upstream"] == "bank", value
            seen = r.json()["headers"]
            assert seen["x-aiproxy-intent"] == "balance", value
            assert float(seen["x-aiproxy-intent-confidence"]) < 1, value
