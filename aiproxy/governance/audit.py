"""`[audit]`: one JSON line per request, hash-chained, written by a thread.

Each record carries `seq` and `prev`, the SHA-256 (hex) of the previous record's line
(without its newline); the chain runs across rotated files, so `aiproxy audit verify`
finds an edited, removed or reordered record anywhere. The newest record's hash is what
to anchor elsewhere to catch a truncated tail (verify prints it; `verify --anchor` checks it).

Durability (`fsync`):
  always    group commit: the thread writes what queued up, fsyncs once, then releases
            the responses waiting for those records. "Answered" means the client got the
            end of the response (the last body byte of a Content-Length body, the final
            chunk, END_STREAM or the trailers, or a whole local reply such as a 401/403):
            the audit filter holds exactly that back until its record is on disk, so a
            crash at any moment loses no record of an answered request. Requests that
            end without an answer (aborted, client gone) are recorded best-effort.
  interval  fsync every fsync_interval_ms; a crash loses at most that much.
  never     written to the OS as they come; fsync left to the kernel.

Rotation: when the file passes rotate_bytes (or is rotate_interval_s old) it is renamed
to PATH.YYYYmmddTHHMMSS.ffffffZ and a new PATH starts; the chain continues across.
An external rotation (logrotate renames PATH to PATH.1 or PATH-YYYYmmdd, then sends
SIGUSR1) works too: reopen() makes the thread sync the old file and append to a new PATH,
and the chain continues across those names as well (audit_tools.chain_of).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiproxy.config.governance import AuditConfig
from aiproxy.pipeline.filters import Filter, FilterFactory

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.audit")

GENESIS = "0" * 64
TAIL_READ = 1 << 20


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


# What a file's name was rotated to: our stamp, or logrotate's (PATH.1; dateext PATH-YYYYmmdd
# and its hourly, minute and second forms).
ROTATED_SUFFIX = re.compile(r"(?:\.\d{8}T\d{6}\.\d{6}Z|\.\d+|-\d{8}(?:\d{2}){0,3})$")


def rotated_files(path: str) -> list[str]:
    """The files PATH was rotated to, by us or by logrotate (not compressed ones)."""
    found = glob.glob(glob.escape(path) + ".[0-9]*") + glob.glob(glob.escape(path) + "-[0-9]*")
    return sorted(f for f in found if ROTATED_SUFFIX.sub("", f) == path)


def _last_line(path: str) -> tuple[bytes | None, int]:
    """(last complete line, length to keep) of a file; a partial last line (a write cut
    short by a crash, never acknowledged) is left out of the length to keep."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None, 0
    with open(path, "rb") as fh:
        start = max(0, size - TAIL_READ)
        fh.seek(start)
        data = fh.read()
    keep = size
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n")
        keep = start + cut + 1 if cut >= 0 else start
        data = data[:cut + 1] if cut >= 0 else b""
    lines = data.rstrip(b"\n").rsplit(b"\n", 1)
    return (lines[-1] if lines and lines[-1] else None), keep


class AuditWriter:
    """The writer thread. submit() from the event loop; with fsync="always" it returns
    a future that completes once the record is durable."""

    def __init__(self, cfg: AuditConfig) -> None:
        self.cfg = cfg
        self.cond = threading.Condition()
        self.queue: deque[tuple[dict, asyncio.Future | None]] = deque()
        self.stopping = False
        self.reopening = False
        self.failed: Exception | None = None
        self.written = 0
        self.fd = -1
        self.size = 0
        self.opened_at = 0.0
        self.prev, self.seq = GENESIS, 0
        self._open()
        self.thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self.thread.start()

    # -- file handling (writer thread, and __init__ before it starts) -------------------------

    def _open(self) -> None:
        path = self.cfg.path
        last, keep = _last_line(path)
        if os.path.exists(path) and keep < os.path.getsize(path):
            log.warning("audit %s: dropping an incomplete last record (written when the "
                        "process stopped; its request was never answered)", path)
            os.truncate(path, keep)
        if last is None:
            # Newest first: the file last written to holds the chain's head, whatever the
            # scheme of its name (a restart after logrotate created an empty PATH).
            for older in sorted(rotated_files(path), key=_mtime, reverse=True):
                last, _ = _last_line(older)
                if last is not None:
                    break
        if last is not None:
            self.prev = line_hash(last)
            try:
                self.seq = int(json.loads(last)["seq"])
            except (ValueError, KeyError, TypeError):
                log.error("audit %s: last record unreadable; the chain continues from its "
                          "hash", path)
        self.fd = _open_log(path)
        self.size = os.fstat(self.fd).st_size
        self.opened_at = time.time()

    def _switch(self, fd: int) -> None:
        """Append to `fd` from now on; the old file was synced."""
        old, self.fd = self.fd, fd
        self.size = os.fstat(fd).st_size
        self.opened_at = time.time()
        try:
            os.close(old)
        except OSError as exc:
            log.error("audit %s: closing the old file: %s", self.cfg.path, exc)
        _fsync_dir(self.cfg.path)

    def _rotate(self) -> None:
        os.fsync(self.fd)
        path = self.cfg.path
        rotated = f"{path}.{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"
        try:
            os.rename(path, rotated)
        except FileNotFoundError:
            rotated = ""  # moved away already (logrotate, its SIGUSR1 still to come)
        # The old descriptor stays ours until the new one is open: a failure leaves the
        # writer appending where it was (under its name again), never to a closed (or
        # reused) descriptor; the next batch tries again.
        try:
            fd = _open_log(path)
        except OSError:
            if rotated:
                with contextlib.suppress(OSError):
                    os.rename(rotated, path)
            raise
        self._switch(fd)

    def _reopen(self) -> None:
        """SIGUSR1: PATH from now on, as nginx does with its logs. A PATH that cannot be
        opened keeps the old file in use; the next SIGUSR1 tries again."""
        try:
            fd = _open_log(self.cfg.path)
        except OSError as exc:
            log.warning("audit: cannot reopen %s, still writing to the old file: %s",
                        self.cfg.path, exc)
            return
        try:
            os.fsync(self.fd)
        except OSError as exc:
            log.error("audit: syncing the old file of %s failed: %s", self.cfg.path, exc)
        self._switch(fd)

    def _due_rotation(self) -> bool:
        cfg = self.cfg
        return self.size > 0 and (self.size >= cfg.rotate_bytes or (
            cfg.rotate_interval_s > 0 and time.time() - self.opened_at >= cfg.rotate_interval_s))

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        dirty = False
        last_sync = time.monotonic()
        while True:
            cfg = self.cfg  # a reload may change the settings (not the path)
            interval = cfg.fsync_interval_ms / 1000
            with self.cond:
                while not self.queue and not self.stopping and not self.reopening:
                    timeout = None
                    if dirty and cfg.fsync == "interval":
                        timeout = max(0.0, last_sync + interval - time.monotonic())
                    elif cfg.rotate_interval_s:
                        timeout = 1.0
                    if not self.cond.wait(timeout) and timeout is not None:
                        break
                batch = list(self.queue)
                self.queue.clear()
                stopping = self.stopping
                reopen, self.reopening = self.reopening, False
            waiting = []
            try:
                if reopen:
                    self._reopen()
                if batch:
                    if self._due_rotation():
                        self._rotate()
                    out: list[bytes] = []
                    size = 0
                    first = (self.seq, self.prev)  # the chain before `out`
                    for record, fut in batch:
                        before = (self.seq, self.prev)
                        self.seq += 1
                        line = encode_record(self.seq, self.prev, record)
                        self.prev = line_hash(line[:-1])
                        if (out or self.size) and self.size + size + len(line) > cfg.rotate_bytes:
                            self._write(out, first)  # a group commit may span a rotation
                            try:
                                self._rotate()
                            except OSError:
                                self.seq, self.prev = before  # `line` is not written
                                raise
                            out, size, first = [], 0, before
                        out.append(line)
                        size += len(line)
                        if fut is not None:
                            waiting.append(fut)
                    self._write(out, first)
                    self.written += len(batch)
                    self.failed = None
                    dirty = True
                now = time.monotonic()
                if dirty and (cfg.fsync == "always" or stopping or (
                        cfg.fsync == "interval" and now - last_sync >= interval)):
                    os.fdatasync(self.fd)
                    dirty = False
                    last_sync = now
                if not batch and self._due_rotation():
                    self._rotate()
            except Exception as exc:
                if isinstance(exc, OSError):
                    log.error("audit write failed: %s", exc)
                else:  # a bug: the thread must live on, or every durable response waits
                    log.exception("audit write failed")
                self.failed = exc
                # The whole batch, not only the records before the failure: a rotation
                # can fail before any of them, and their responses wait on them.
                self._settle([fut for _, fut in batch if fut is not None], exc)
                waiting = []
                if stopping:
                    return
                continue
            self._settle(waiting, None)
            if stopping:
                os.close(self.fd)
                return

    def _write(self, lines: list[bytes], first: tuple[int, str]) -> None:
        """Append lines; `first` is (seq, prev) before them. When the write fails (a full
        disk) the part that got in is cut off again and the chain goes back to `first`:
        a torn line would make the next record unreadable, and records chained to ones
        that never reached the file would read as tampering in `audit verify`."""
        data = memoryview(b"".join(lines))
        view = data
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError:
            self.seq, self.prev = first
            if len(view) < len(data):
                try:
                    os.ftruncate(self.fd, self.size)
                except OSError as exc:
                    log.error("audit %s: a partly written record stays: %s", self.cfg.path, exc)
            raise
        self.size += len(data)

    @staticmethod
    def _settle(futures: list[asyncio.Future], exc: Exception | None) -> None:
        by_loop: dict[Any, list[asyncio.Future]] = {}
        for fut in futures:
            by_loop.setdefault(fut.get_loop(), []).append(fut)
        for loop, futs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, futs, exc)
            except RuntimeError:
                pass  # the loop is gone

    # -- the loop side ------------------------------------------------------------------------------

    def submit(self, record: dict, durable: bool = False) -> asyncio.Future | None:
        fut = asyncio.get_running_loop().create_future() if durable else None
        with self.cond:
            self.queue.append((record, fut))
            self.cond.notify()
        return fut

    def reopen(self) -> None:
        """Append to a new PATH (SIGUSR1, after logrotate renamed the file)."""
        with self.cond:
            self.reopening = True
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)


def encode_record(seq: int, prev: str, record: dict) -> bytes:
    """One audit line (LF included). A record JSON cannot hold (a key that is not a
    string, a cycle) still takes its place in the chain, as what is known of it: a gap
    in seq would read as tampering in `audit verify`."""
    try:
        text = json.dumps({"seq": seq, "prev": prev, **record}, separators=(",", ":"),
                          ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        log.error("audit record %d could not be encoded (%s): written as unencodable",
                  seq, exc)
        text = json.dumps({"seq": seq, "prev": prev,
                           "unencodable": f"{type(exc).__name__}: {exc}",
                           "keys": sorted(repr(k) for k in record)},
                          separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace") + b"\n"


def _resolve(futures: list[asyncio.Future], exc: Exception | None) -> None:
    for fut in futures:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)


def _open_log(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the record --------------------------------------------------------------------------------


def _tokens(llm: Any) -> dict[str, Any] | None:
    if llm is None:
        return None
    usage = getattr(llm, "usage", None)
    out = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = getattr(llm, name, None)
        if value is None and usage is not None:
            value = usage.get(name) if isinstance(usage, dict) else getattr(usage, name, None)
        if value is not None:
            out[name.removesuffix("_tokens")] = value
    estimated = getattr(llm, "estimated", None)
    if estimated is not None:
        out["estimated"] = bool(estimated)
    return out or None


def record_of(ex: Exchange, outcome: str) -> dict[str, Any]:
    ident = ex.identity
    route = ex.route
    llm = ex.llm
    gov = ex.gov
    model = getattr(llm, "model", None) if llm is not None else None
    if model is None:
        model = gov.get("model")
    if model is None and route is not None and route.cfg.model:
        model = route.cfg.model.decode("latin-1")
    policy = gov.get("policy")
    timings = ex.timings()
    return {
        "time": datetime.fromtimestamp(time.time() - timings["total"], UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z"),
        "trace_id": ex.trace_id,
        "span_id": gov.get("span_id"),
        "identity": None if ident is None else {
            "sub": ident.subject, "kind": ident.kind, "roles": list(ident.roles)},
        "client": ex.down.peer.decode("latin-1"),
        "method": ex.method.decode("latin-1"),
        "path": ex.path.decode("latin-1"),
        "route": route.name if route is not None else None,
        "cluster": ex.cluster.name if ex.cluster is not None else None,
        "model": model,
        "intent": ex.intent,
        "domain": ex.intent_domain,
        "decision": None if policy is None else {"result": policy[0], "rule": policy[1]},
        "guard": gov.get("guard"),
        "redactions": gov.get("redactions"),
        "tokens": _tokens(llm),
        "status": ex.status,
        "outcome": outcome,
        "bytes_in": ex.req_bytes,
        "bytes_out": ex.resp_bytes,
        "timings_ms": {k: round(v * 1000, 3) for k, v in timings.items()},
    }


class AuditFilter(Filter):
    __slots__ = ("writer", "durable", "recorded", "held", "hold_last")

    def __init__(self, writer: AuditWriter, durable: bool) -> None:
        self.writer = writer
        self.durable = durable
        self.recorded = False
        self.held = b""
        self.hold_last = False

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        # A Content-Length body is complete at its last byte: with fsync="always" that
        # byte waits for the record (see finishing()).
        self.hold_last = self.durable and resp.get(b"content-length") not in (None, b"0")
        return resp

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        if not self.hold_last or not data:
            return data
        data = self.held + data
        self.held = data[-1:]
        return data[:-1]

    def response_end(self, ex: Exchange) -> bytes:
        held = self.held
        self.held = b""
        return held

    def finishing(self, ex: Exchange) -> asyncio.Future | None:
        if self.recorded:
            return None
        self.recorded = True
        return self.writer.submit(record_of(ex, "answered"), self.durable)

    def done(self, ex: Exchange) -> None:
        if not self.recorded:
            self.recorded = True
            if ex.client_lost:
                outcome = "client_lost"
            else:
                outcome = "aborted" if ex.head_sent else "unanswered"
            self.writer.submit(record_of(ex, outcome))


class AuditFactory(FilterFactory):
    name = "audit"

    def __init__(self, writer: AuditWriter) -> None:
        self.writer = writer
        self.durable = writer.cfg.fsync == "always"

    def start(self, ex: Exchange) -> Filter:
        return AuditFilter(self.writer, self.durable)


class AuditState:
    """The writer, kept across reloads while the file and its settings stay the same."""

    def __init__(self, cfg: AuditConfig) -> None:
        self.cfg = cfg
        self.writer = AuditWriter(cfg)
        self.factory = AuditFactory(self.writer)

    def close(self) -> None:
        self.writer.close()

    def reopen(self) -> None:
        self.writer.reopen()

    def metric_families(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w = self.writer
        yield CounterMetricFamily("aiproxy_audit_records", "Audit records written",
                                  value=w.written)
        yield GaugeMetricFamily("aiproxy_audit_write_failed",
                                "1 if the last audit write failed", value=int(w.failed is not None))


RETIRE_AFTER_S = 60.0  # a replaced writer still takes records from in-flight requests


def make_state(config: Config, previous: Any) -> Any:
    """The same writer across reloads while the path stays (one chain, one thread);
    other settings change in place. A writer whose file is no longer configured is
    closed a while later, once the requests of the old config are done."""
    cfg = config.audit
    if isinstance(previous, AuditState):
        if cfg is not None and previous.cfg.path == cfg.path:
            previous.cfg = previous.writer.cfg = cfg
            previous.factory.durable = cfg.fsync == "always"
            return previous
        timer = threading.Timer(RETIRE_AFTER_S, previous.writer.close)
        timer.daemon = True
        timer.start()
    return AuditState(cfg) if cfg is not None else None


def build(config: Config, route: RouteConfig, state: AuditState) -> FilterFactory:
    return state.factory

