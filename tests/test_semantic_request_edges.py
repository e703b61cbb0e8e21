"""Request-path edges of semantic routing, through a real proxy process, real upstreams
(demo HTTP upstreams, a grpcio server) and the shipped model run by the native head and
by onnxruntime."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import intent_routes_config, start_demo_upstream, stop_process

BANK = "how much money is in my checking account"


@pytest.fixture(scope="module")
def bank_and_general():
    bank, bank_port = start_demo_upstream("bank")
    general, general_port = start_demo_upstream("general")
    yield bank_port, general_port
    stop_process(bank)
    stop_process(general)


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

