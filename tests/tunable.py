"""A small HTTP/1.1 keep-alive upstream whose behaviour a test changes while it runs.

It runs an asyncio server in its own thread. Every response is JSON describing the
request (method, target, headers, body length) plus `upstream` (its name) and an
OpenAI-style `usage`; `seen` keeps every request's headers; `delay_ms`, `status`, `fail_first` and `extra_headers` can be set
from the test at any time. GET /healthz answers with `health_status`.
"""

from __future__ import annotations

import asyncio
import json
import threading


class TunableUpstream:
    def __init__(self, name: str, delay_ms: float = 0, status: int = 200) -> None:
        self.name = name
        self.delay_ms = delay_ms
        self.status = status
        self.health_status = 200
        self.fail_first = 0  # answer this many requests with fail_status first
        self.fail_status = 503
        self.metrics_text = ""  # served at GET /metrics
        self.reset_first = 0  # close this many connections without answering first
        self.extra_headers: dict[str, str] = {}
        self.tokens = 100
        self.requests = 0
        self.seen: list[dict[str, str]] = []  # the headers of every request but /healthz
        self.health_checks = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TunableUpstream:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("tunable upstream did not start")
        return self

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        data = await reader.readexactly(size + 2)
                        body += data[:-2]
                        if size == 0:
                            break
                await self._respond(writer, method, target, headers, body)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError,
                asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, method: str, target: str,
                       headers: dict[str, str], body: bytes) -> None:
        if target == "/metrics":
            payload = self.metrics_text.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d"
                         b"\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            return
        if target == "/healthz":
            self.health_checks += 1
            status = self.health_status
            payload = b'{"ok": true}'
            extra: dict[str, str] = {}
        else:
            self.requests += 1
            self.seen.append(headers)
            if self.reset_first > 0:
                self.reset_first -= 1
                writer.transport.abort()
                return
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self.delay_ms:
                    await asyncio.sleep(self.delay_ms / 1000)
            finally:
                self.in_flight -= 1
            if self.fail_first > 0:
                self.fail_first -= 1
                status = self.fail_status
            else:
                status = self.status
            payload = json.dumps({
                "upstream": self.name, "method": method, "target": target,
                "headers": headers, "body_bytes": len(body),
                "body": body.decode("utf-8", "replace") if len(body) <= 4096 else None,
                "usage": {"total_tokens": self.tokens},
            }).encode()
            extra = dict(self.extra_headers)
        out = [f"HTTP/1.1 {status} X", "Content-Type: application/json",
               f"Content-Length: {len(payload)}", f"X-Upstream: {self.name}",
               "Server: tunable"]
        out += [f"{k}: {v}" for k, v in extra.items()]
        writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + payload)
        await writer.drain()
