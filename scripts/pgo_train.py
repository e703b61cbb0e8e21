"""The training run of a profile-guided build (scripts/pgo_build.sh).

Starts the bundled demo upstreams and aiproxy from this tree on free loopback ports with
the bundled config (config/aiproxy.toml, one worker so the counters are written when
it exits), sends it the traffic it is built for, then stops it with SIGTERM:

- keep-alive GETs, small and 16 KiB bodies, and a 1 MiB download;
- OpenAI-style chat completions, plain and streamed (SSE), through the intent router;
- request bodies sent chunked, error statuses from the upstream;
- malformed requests on raw sockets, which get their 400s.

The mix matters more than the volume: GCC lays out and inlines by what ran here.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import (  # noqa: E402 (the repo root goes on the path first)
    free_port,
    process_log,
    start_demo_upstream,
    start_process,
    stop_process,
    wait_port,
)

PROMPTS = [
    "please transfer 200 dollars from checking to savings",
    "what is my account balance",
    "tell me a joke about cats",
    "book a table for two at an italian restaurant tonight",
    "what's the weather like in paris tomorrow",
    "set an alarm for 6 am",
]
MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def training_config(port: int, admin: int, upstreams: list[int]) -> str:
    """config/aiproxy.toml with this run's ports and one worker."""
    text = (REPO / "config" / "aiproxy.toml").read_text()
    text = re.sub(r'(?m)^workers = .*$', "workers = 1", text)
    text = text.replace('"127.0.0.1:8080"', f'"127.0.0.1:{port}"')
    text = text.replace('"127.0.0.1:9901"', f'"127.0.0.1:{admin}"')
    endpoints = ", ".join(f'"127.0.0.1:{p}"' for p in upstreams)
    return text.replace('["127.0.0.1:9001", "127.0.0.1:9002"]', f"[{endpoints}]")


async def _times(n: int, parallel: int, one) -> None:
    async def worker(k: int) -> None:
        for i in range(k, n, parallel):
            await one(i)

    await asyncio.gather(*(worker(k) for k in range(parallel)))


async def drive(base: str, scale: int) -> dict[int, int]:
    statuses: dict[int, int] = {}

    async def take(resp: aiohttp.ClientResponse) -> None:
        await resp.read()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1

    async def chunks(data: bytes):
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    conn = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(base, connector=conn) as s:
        async def small(i: int) -> None:
            async with s.get("/echo", params={"i": str(i % 7)}) as r:
                await take(r)

        async def sized(i: int) -> None:
            async with s.get("/bytes/16384" if i % 50 else "/bytes/1048576") as r:
                await take(r)

        async def chat(i: int) -> None:
            body = {"model": "gpt-4o-mini", "stream": i % 4 == 0,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
            async with s.post("/v1/chat/completions", json=body) as r:
                await take(r)

        async def upload(i: int) -> None:
            async with s.post("/echo", data=chunks(b"x" * (2000 + i))) as r:
                await take(r)

        async def status(i: int) -> None:
            async with s.get(f"/status/{(404, 500, 204)[i % 3]}") as r:
                await take(r)

        await _times(300 * scale, 8, small)
        await _times(100 * scale, 4, sized)
        await _times(100 * scale, 8, chat)
        await _times(30 * scale, 4, upload)
        await _times(30 * scale, 4, status)
    return statuses


def malformed(port: int) -> None:
    for request in MALFORMED:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            while sock.recv(65536):
                pass


def main() -> int:
    scale = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    # SIGTERM (pgo_build.sh's timeout) unwinds through the finally below, which stops the
    # processes this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    upstreams = [start_demo_upstream(name) for name in ("demo-a", "demo-b")]
    proxy = None
    try:
        port, admin = free_port(), free_port()
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
            fh.write(training_config(port, admin, [p for _, p in upstreams]))
        proxy = start_process([sys.executable, "-m", "aiproxy", "-c", fh.name])
        wait_port("127.0.0.1", port, timeout=60, proc=proxy)
        statuses = asyncio.run(drive(f"http://127.0.0.1:{port}", scale))
        malformed(port)
        print(f"pgo training: responses by status {dict(sorted(statuses.items()))}")
        log = stop_process(proxy)
        proxy = None
        Path(fh.name).unlink()
        if statuses.get(200, 0) < 100 * scale or "Traceback" in log:
            print(f"pgo training: the proxy did not serve as expected:\n{log}", file=sys.stderr)
            return 1
        return 0
    except Exception:
        if proxy is not None:
            print(process_log(proxy), file=sys.stderr)
        raise
    finally:
        if proxy is not None:
            stop_process(proxy)
        for proc, _ in upstreams:
            stop_process(proc)


if __name__ == "__main__":
    sys.exit(main())
