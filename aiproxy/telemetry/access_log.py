"""JSON access log: lines are built on the loop, written by a background thread.

The loop only appends to a list; a timer hands the batch to the writer thread,
so a slow disk never stalls request handling. SIGUSR1 reopens the file (for
log rotation)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
from typing import IO, Any

import orjson
from cython.cimports.libc.math import rint

log = logging.getLogger("aiproxy.access_log")

_REOPEN = object()
_STOP = object()
# For what orjson refuses (an integer past 64 bits from a client's JSON, say).
_json_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=repr).encode


def encode_line(record: dict[str, Any]) -> bytes:
    """One compact JSON line, UTF-8. orjson takes about a tenth of the time json.dumps
    does, which builds its encoder and calls back into Python per float."""
    try:
        return orjson.dumps(record, default=repr)
    except TypeError:
        # A lone surrogate (a client's "\\ud800") goes out as that JSON escape again.
        return _json_encode(record).encode("utf-8", "backslashreplace")


class AccessLog:
    def __init__(self, path: str, loop: asyncio.AbstractEventLoop,
                 flush_interval: float) -> None:
        self.path = path
        self.loop = loop
        self.flush_interval = flush_interval
        self.pending: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._writer, name="aiproxy-access-log",
                                       daemon=True)
        self.thread.start()

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(encode_line(record))
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

    def _open(self) -> IO[bytes]:
        if self.path == "-":
            return sys.stderr.buffer
        return open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115

    def _writer(self) -> None:
        out = self._open()
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            if item is _REOPEN:
                # As nginx does: a file that cannot be opened keeps the old one in use (and
                # this thread alive), so a failed rotation never loses every later line.
                try:
                    new = self._open()
                except OSError as exc:
                    log.warning("access log: cannot reopen %s, still writing to the old "
                                "file: %s", self.path, exc)
                    continue
                if out is not sys.stderr.buffer:
                    try:
                        out.close()
                    except OSError:
                        pass  # what it buffered could not be written (a full disk)
                out = new
                continue
            try:
                out.write(b"\n".join(item) + b"\n")
                out.flush()
            except OSError:
                pass  # a full disk must not take the proxy down
        if out is not sys.stderr.buffer:
            out.close()


_second = -1
_second_text = ""
_MILLIS = tuple(f"{i:03d}Z" for i in range(1000))


def iso_now() -> str:
    """UTC now as 2026-11-30T08:00:00.123Z; the text up to the second is made once a second."""
    global _second, _second_text
    now = time.time()
    second = int(now)
    if second != _second:
        _second_text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
        _second = second
    return _second_text + _MILLIS[min(int((now - second) * 1000), 999)]


def ms(seconds: float) -> float:
    """Seconds as milliseconds with three decimals (what round(seconds * 1000, 3) gives,
    at a fraction of its cost: round() with digits goes through a decimal string).
    rint rounds half to even, as round() does."""
    return rint(seconds * 1e6) / 1000


def resolve(path: str, config_source: str) -> str | None:
    if path == "off":
        return None
    if path == "-" or os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(config_source)), path)
