"""[cache] as a shared cache (RFC 9111) in what it stores and for how long: the
response's Cache-Control, Expires and Age, the request's Cache-Control, Authorization,
which fields a hit replays, and streams that end without proof they are whole. The
upstream is scripted: the last user message is a JSON object naming the response
fields to send ("h") and how to frame the body ("frame": length, chunked, close)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import StreamServerThread


class Upstream(StreamServerThread):
    """Every answer has a new id (`c<N>`), so a replay is told from a fresh answer."""

    def __init__(self) -> None:
        self.calls = 0
        super().__init__(self.serve)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self.answer(json.loads(body), writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def answer(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        self.calls += 1
        n = self.calls
        script = json.loads(req["messages"][-1]["content"])
        fields = b"".join(f"{k}: {v}\r\n".encode() for k, v in script.get("h", []))
        frame = script.get("frame", "length")
        if req.get("stream"):
            pieces = [b'data: {"id": "c%d", "n": %d}\n\n' % (n, i) for i in range(3)]
            pieces.append(b"data: [DONE]\n\n")
            ctype = b"text/event-stream"
        else:
            pieces = [json.dumps({"id": f"c{n}", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}]}).encode()]
            ctype = b"application/json"
        if script.get("cut"):
            pieces = pieces[:2]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\n" + fields
        if frame == "length":
            head += b"Content-Length: %d\r\n" % sum(map(len, pieces))
        elif frame == "chunked":
            head += b"Transfer-Encoding: chunked\r\n"
        else:
            head += b"Connection: close\r\n"
        writer.write(head + b"\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if frame == "chunked" else piece)
            await writer.drain()
        if frame == "chunked" and not script.get("cut"):
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return frame != "close" and not script.get("cut")


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


def _proxy(start_proxy, port: int, cache: str = ""):
    return start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"

[cache]
{cache}
""")


def _body(script: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": json.dumps(script)}],
            **more}


def _twice(c: httpx.Client, url: str, script: dict[str, Any], **headers: str
           ) -> list[httpx.Response]:
    return [c.post(url, json=_body(script), headers=headers) for _ in range(2)]


def _marks(rs: list[httpx.Response]) -> list[str]:
    return [r.headers["x-aiproxy-cache"] for r in rs]


def _id(r: httpx.Response) -> str:
    return r.text.split('"id": "', 1)[1].split('"', 1)[0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cc", ["no-cache", "private", 'no-cache="set-cookie"',
                                'private="x-user", max-age=60', "public, no-cache",
                                "no-store"])
def test_a_response_that_forbids_reuse_is_not_stored(start_proxy, upstream, cc, stream):
    """RFC 9111 5.2.2: no-store and no-cache (reuse only after revalidation, which this
    cache does not do) and, in a shared cache, private (the default scope is a tenant,
    not one user) keep a response out of the cache, for event streams too."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    script = {"h": [["Cache-Control", cc]], "frame": "chunked"}
    with httpx.Client() as c:
        rs = [c.post(url, json=_body(script, stream=stream)) for _ in range(2)]
    assert _marks(rs) == ["miss", "miss"]
    assert _id(rs[0]) != _id(rs[1]) and upstream.calls == 2
