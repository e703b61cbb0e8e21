"""Supervisor <-> worker control channel: JSON lines over a socketpair.

A message with "op" is a request and gets exactly one reply carrying the same "id";
a message with "event" is one-way (a worker saying it is ready, or handing over its
final metrics). Requests are rare (reloads, scrapes), so JSON is plenty.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("aiproxy.server")

# A metrics snapshot of a worker with many routes and endpoints is well above the
# StreamReader default of 64 KiB.
LINE_LIMIT = 64 * 1024 * 1024

Handler = Callable[..., Awaitable[Any]]


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.closed = False

    @classmethod
    async def open(cls, sock: Any) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=LINE_LIMIT)
        return cls(reader, writer)

    def send(self, message: dict[str, Any]) -> None:
        if not self.closed:
            self.writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def event(self, name: str, **fields: Any) -> None:
        self.send({"event": name, **fields})

    async def call(self, op: str, timeout: float | None = None, **fields: Any) -> Any:
        """Send a request and wait for its result; ConnectionError if the peer goes away,
        RuntimeError if its handler failed, TimeoutError after `timeout` seconds."""
        if self.closed:
            raise ConnectionError("channel closed")
        self.next_id += 1
        ident = self.next_id
        future = asyncio.get_running_loop().create_future()
        self.pending[ident] = future
        self.send({"id": ident, "op": op, **fields})
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.pending.pop(ident, None)

    async def serve(self, handlers: dict[str, Handler],
                    on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        """Read until EOF: answer requests with `handlers[op](**fields)`, pass events to
        `on_event`, resolve replies to our own calls. Requests run as tasks so a slow
        one (a reload loading a model) does not hold up the others."""
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    line = await self.reader.readline()
                except (ConnectionError, asyncio.LimitOverrunError, ValueError):
                    break
                if not line:
                    break
                message = json.loads(line)
                if "op" in message:
                    task = asyncio.create_task(self._answer(handlers, message))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif "event" in message:
                    if on_event is not None:
                        on_event(message.pop("event"), message)
                else:
                    future = self.pending.get(message.get("id"))
                    if future is not None and not future.done():
                        if "error" in message:
                            future.set_exception(RuntimeError(message["error"]))
                        else:
                            future.set_result(message.get("result"))
        finally:
            self.closed = True
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("channel closed"))

    async def _answer(self, handlers: dict[str, Handler], message: dict[str, Any]) -> None:
        ident = message.pop("id", None)
        op = message.pop("op")
        handler = handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            result = await handler(**message)
        except Exception as exc:  # the reply says what failed; the worker keeps serving
            log.exception("control request %s failed", op)
            self.send({"id": ident, "error": f"{type(exc).__name__}: {exc}"})
        else:
            self.send({"id": ident, "result": result})

    async def close(self) -> None:
        self.closed = True
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
