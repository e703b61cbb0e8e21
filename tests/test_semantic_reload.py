"""A model file swapped under a running proxy takes effect on SIGHUP, without a restart;
a broken one is refused on reload while the old model keeps serving.

Real parts only: the proxy process, two demo upstreams, the shipped model, and a second
model trained here by `aiproxy router train` (a few seconds of numpy)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from aiproxy.semantic.classifier import BUILTINS
from aiproxy.semantic.cli import main as router_main
from tests.support import (
    admin_block,
    free_port,
    intent_routes_config,
    start_demo_upstream,
    stop_process,
    wait_port,
)

BANKING_TEXT = "how much money is in my checking account"

# The second model knows two intents in domains the routes do not name, so the request that
# the shipped model sends to the bank (domain "banking") goes to the general cluster.
SECOND = {
    "account_question": ("support", ["money", "checking", "account", "much", "how", "is",
                                     "balance", "my", "in"]),
    "chitchat": ("smalltalk", ["hello", "joke", "weather", "nice", "day", "you", "are",
                               "friend", "fun"]),
}


@pytest.fixture(scope="module")
def upstreams():
    bank, bank_port = start_demo_upstream("bank")
    general, general_port = start_demo_upstream("general")
    yield bank_port, general_port
    stop_process(bank)
    stop_process(general)


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("second")
    rng = random.Random(7)
    rows = []
    for intent, (domain, words) in SECOND.items():
        for _ in range(60):
            rows.append({"text": " ".join(rng.sample(words, 5)), "intent": intent,
                         "domain": domain})
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = d / "second.onnx"
    assert router_main(["train", "--data", str(data), "--seed", "5", "--buckets", "4096",
                        "--dim", "16", "--epochs", "4", "--batch", "16", "--lr-embed", "0.05",
                        "--average-from", "0", "--dtype", "float32", "-q", "-o", str(out)]) == 0
    return out


def _config(model: Path, bank: int, general: int, admin: int) -> str:
    return intent_routes_config(bank, general, f'model = "{model}"') + admin_block(admin)


def _ask(proxy) -> tuple[str, str]:
    body = json.dumps({"messages": [{"role": "user", "content": BANKING_TEXT}]})
    r = httpx.post(proxy.url + "/echo", content=body,
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-upstream"], r.json()["headers"]["x-aiproxy-intent"]


def _reloads(admin: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("aiproxy_config_reloads_total", "aiproxy_config_reload_failures_total"):
            values[name] = float(value)
    return (values["aiproxy_config_reloads_total"],
            values["aiproxy_config_reload_failures_total"])


def _all_workers_up(admin: int) -> bool:
    """Every worker serves. A worker still starting when SIGHUP arrives catches up with
    its own reload once ready, after the supervisor has counted the reload."""
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=10).text
    up = [line for line in text.splitlines() if line.startswith("aiproxy_worker_up{")]
    return bool(up) and all(line.endswith(" 1.0") for line in up)


def _wait_for(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _swap(target: Path, source_bytes: bytes, keep_mtime: bool) -> None:
    """Replace `target` atomically (rename over it), as a deploy would."""
    before = target.stat()
    tmp = target.with_suffix(".new")
    tmp.write_bytes(source_bytes)
    if keep_mtime:  # the new file claims the old one's mtime: the swap must still count
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(tmp, target)


def test_swapped_model_takes_effect_on_sighup(start_proxy, upstreams, second_model, tmp_path):
    model = tmp_path / "intent.onnx"
    shutil.copyfile(BUILTINS["clinc150"], model)
    admin = free_port()
    proxy = start_proxy(_config(model, *upstreams, admin))
    wait_port("127.0.0.1", admin)
    _wait_for(lambda: _all_workers_up(admin), "every worker")
    assert _ask(proxy) == ("bank", "balance")

    # a different model under the same path (same mtime, even): SIGHUP switches to it
    _swap(model, second_model.read_bytes(), keep_mtime=True)
    proxy.proc.send_signal(signal.SIGHUP)
    _wait_for(lambda: _reloads(admin)[0] >= 1, "the reload")
    assert _ask(proxy) == ("general", "account_question")
    assert proxy.proc.poll() is None

    # a broken file is refused: the reload fails, names the file, and model 2 keeps serving
    _swap(model, b"\x08\x07this is not an onnx model", keep_mtime=False)
    proxy.proc.send_signal(signal.SIGHUP)
    _wait_for(lambda: _reloads(admin)[1] >= 1, "the failed reload")
    assert _reloads(admin) == (1, 1)
    for _ in range(3):
        assert _ask(proxy) == ("general", "account_question")
    log = _wait_for(lambda: "reload rejected" in proxy.log() and proxy.log(),
                    "the rejection in the log")
    assert f"{model}: cannot load ONNX model" in log
    # the admin API's reload says the same to its caller
    r = httpx.post(f"http://127.0.0.1:{admin}/config/reload", timeout=30)
    assert r.status_code == 400
    assert f"{model}: cannot load ONNX model" in r.json()["error"]["message"]
    assert _reloads(admin) == (1, 2)
    assert _ask(proxy) == ("general", "account_question")

    # and a good file again is picked up by the next SIGHUP
    _swap(model, BUILTINS["clinc150"].read_bytes(), keep_mtime=False)
    proxy.proc.send_signal(signal.SIGHUP)
    _wait_for(lambda: _reloads(admin)[0] >= 2, "the second reload")
    assert _ask(proxy) == ("bank", "balance")


def test_a_model_replaced_while_it_loads_is_loaded_again(tmp_path, second_model, monkeypatch):
    """The file stamp that decides "same model, reuse it" on reload is the one taken before
    the load: a file swapped during the load is not vouched for (as policy files)."""
    from aiproxy.config import load_config_text
    from aiproxy.semantic import router as router_mod

    model = tmp_path / "intent.onnx"
    shutil.copyfile(BUILTINS["clinc150"], model)
    text = '[[listeners]]\nname = "l"\naddress = "127.0.0.1:9"\n' + _config(model, 1, 2, 3)
    cfg = load_config_text(text, str(tmp_path / "aiproxy.toml")).semantic
    real = router_mod.IntentModel

    def load_then_swap(*args, **kwargs):
        loaded = real(*args, **kwargs)
        _swap(model, second_model.read_bytes(), keep_mtime=True)
        monkeypatch.setattr(router_mod, "IntentModel", real)
        return loaded

    monkeypatch.setattr(router_mod, "IntentModel", load_then_swap)
    first = router_mod.SemanticRouter(cfg, router_mod.load_model(cfg))
    assert "balance" in first.model.labels
    again = router_mod.load_model(cfg, first)
    assert again is not first.model
    assert set(again.labels) == set(SECOND)
    # and with nothing changed since, the reload reuses it
    assert router_mod.load_model(cfg, router_mod.SemanticRouter(cfg, again)) is again
