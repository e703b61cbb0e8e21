"""JSON access log: lines are built on the loop, written by a background thread.

The loop only appends to a list; a timer hands the batch to the writer thread,
so a slow disk never stalls request handling. SIGUSR1 reopens the file (for
log rotation)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
from typing import IO, Any

_REOPEN = object()
_STOP = object()


class AccessLog:
    def __init__(self, path: str, loop: asyncio.AbstractEventLoop,
                 flush_interval: float) -> None:
        self.path = path
        self.loop = loop
        self.flush_interval = flush_interval
        self.pending: list[str] = []
        self.timer: asyncio.TimerHandle | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._writer, name="aiproxy-access-log",
                                       daemon=True)
        self.thread.start()

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(json.dumps(record, separators=(",", ":")))
        if self.timer is None:
            self.timer = self.loop.call_later(self.flush_interval, self.flush)

    def flush(self) -> None:
        self.timer = None
        if self.pending:
            batch, self.pending = self.pending, []
            self.queue.put(batch)

    def reopen(self) -> None:
        self.queue.put(_REOPEN)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.flush()
        self.queue.put(_STOP)
        self.thread.join(timeout=5)

    def _open(self) -> IO[str]:
        if self.path == "-":
            return sys.stderr
        return open(self.path, "a", buffering=1 << 16, encoding="utf-8")  # noqa: SIM115

    def _writer(self) -> None:
        out = self._open()
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            if item is _REOPEN:
                if out is not sys.stderr:
                    out.close()
                out = self._open()
                continue
            try:
                out.write("\n".join(item) + "\n")
                out.flush()
            except OSError:
                pass  # a full disk must not take the proxy down
        if out is not sys.stderr:
            out.close()


def iso_now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def resolve(path: str, config_source: str) -> str | None:
    if path == "off":
        return None
    if path == "-" or os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(config_source)), path)
