"""Access log line encoding and timestamps (aiproxy/telemetry/access_log.py)."""

from __future__ import annotations

import calendar
import json
import re
import time

from aiproxy.telemetry.access_log import encode_line, iso_now, ms


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
