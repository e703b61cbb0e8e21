"""Access log line encoding and timestamps (aiproxy/telemetry/access_log.py)."""

from __future__ import annotations

import calendar
import json
import re
import signal
import time
from pathlib import Path

import httpx

from aiproxy.telemetry.access_log import encode_line, iso_now, ms
from tests.conftest import simple_config


def test_line_is_compact_json_that_round_trips() -> None:
    record = {"path": "/caf\u00e9", "status": 200, "duration_ms": 1.234, "intent": None,
              "timings_ms": {"upstream_ttfb": 0.5}, "llm": {"model": 2**70}}
    line = encode_line(record)
    assert b"\n" not in line and b", " not in line
    assert json.loads(line) == record  # a client's 2**70 falls back to the json module


def test_iso_now_is_utc_milliseconds() -> None:
    before = time.time()
    text = iso_now()
    after = time.time()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", text)
    stamp = calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S"))
    assert int(before) <= stamp + int(text[20:23]) / 1000 + 0.001 and stamp <= after


def test_ms_matches_round_to_microseconds() -> None:
    for seconds in (0.0, 0.0004995, 0.0123456, 1.0, 12.3456789):
        assert ms(seconds) == round(seconds * 1000, 3)


def _lines(path: Path, at_least: int, timeout: float = 10) -> list[dict]:
    """The access log's lines, once there are at least `at_least` (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = ([json.loads(x) for x in path.read_text().splitlines()]
                 if path.is_file() else [])
        if len(lines) >= at_least or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_failed_reopen_keeps_logging(start_proxy, demo_upstream, tmp_path: Path) -> None:
    """SIGUSR1 when the path cannot be opened (here: a directory took its place) keeps
    the old file, as nginx does; the next SIGUSR1 that can open it moves on to it. The
    writer thread used to die on the failed open, and every later line was lost."""
    log = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream)
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n')
    with httpx.Client(base_url=proxy.url) as client:
        assert client.get("/echo/1").status_code == 200
        assert [x["path"] for x in _lines(log, 1)] == ["/echo/1"]
        rotated = tmp_path / "access.log.1"
        log.rename(rotated)
        log.mkdir()
        proxy.proc.send_signal(signal.SIGUSR1)
        assert client.get("/echo/2").status_code == 200
        assert [x["path"] for x in _lines(rotated, 2)] == ["/echo/1", "/echo/2"]
        log.rmdir()
        proxy.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not log.is_file():  # reopened: later lines go to the new file
            assert time.monotonic() < deadline, "the access log was never reopened"
            time.sleep(0.05)
        assert client.get("/echo/3").status_code == 200
        assert [x["path"] for x in _lines(log, 1)] == ["/echo/3"]
    assert [x["path"] for x in _lines(rotated, 2)] == ["/echo/1", "/echo/2"]
    assert "cannot reopen" in proxy.log()


def test_a_request_refused_before_it_was_one_is_logged(start_proxy, demo_upstream,
                                                       tmp_path: Path) -> None:
    """nginx logs its 400s: a message the parser refuses (here: Content-Length and
    Transfer-Encoding together, then a head too large) gets an access line with its
    status, bytes and why, and no request fields it never had."""
    import socket

    log = tmp_path / "access.log"
    # One worker: two workers write their lines apart, in either order.
    proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(demo_upstream)
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n')
    smuggle = (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    huge = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n"
    for raw in (smuggle, huge):
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            s.sendall(raw)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 431 "))
    lines = _lines(log, 2)
    assert [x["status"] for x in lines] == [400, 431]
    for line in lines:
        assert line["method"] is None and line["path"] is None and line["route"] is None
        assert line["rejected"] and line["client"] == "127.0.0.1"
        assert line["bytes_out"] > 0 and line["bytes_in"] > 0


def test_encode_line_keeps_a_lone_surrogate_as_its_escape() -> None:
    """orjson refuses a lone surrogate and the fallback's str.encode() raised: the line
    was lost and the exception escaped into the exchange's end."""
    line = encode_line({"model": "a\ud800b", "status": 200})
    assert json.loads(line) == {"model": "a\ud800b", "status": 200}
