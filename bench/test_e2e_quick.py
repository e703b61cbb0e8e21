"""A functional pass of the end-to-end comparison (`bench/e2e.py --quick`).

Slow (about a minute), so `make test` leaves it out; run it with
`python -m pytest bench -m slow`. It checks that every proxy answered every case and that
the tables were printed; it asserts nothing about timings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e.py"
PROXIES = ("nginx", "haproxy", "aiproxy")


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None or any(
        os.access(f"{d}/{tool}", os.X_OK) for d in ("/usr/sbin", "/sbin"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_quick(tmp_path: Path) -> None:
    missing = [t for t in ("nginx", "haproxy", "wrk") if not _have(t)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/bootstrap.sh --test)")
    out_json = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(E2E), "--quick", "--no-install", "--json", str(out_json)],
        capture_output=True, text=True, timeout=560)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report

    doc = json.loads(out_json.read_text())
    assert doc["ok"], report
    assert set(doc["cases"]) == {"small", "16k", "1m"}, report
    for case, by_proxy in doc["cases"].items():
        assert set(by_proxy) == set(PROXIES), (case, report)
        for name, res in by_proxy.items():
            for run in res["rounds"]:
                assert run["requests"] > 0, (case, name, report)
                assert run["errors"]["status_errors"] == 0, (case, name, report)
                assert run["errors"]["connect_errors"] == 0, (case, name, report)
    assert set(doc["idle"]) == set(PROXIES), report
    for name, res in doc["idle"].items():
        assert res["failed"] == 0, (name, report)
        assert res["median"]["open_at_end"] == doc["settings"]["idle_connections"], (name, report)

    # The printed tables: one per case plus the idle one, a row for every proxy in each.
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("| proxy ") for line in lines) == 4, report
    for name in PROXIES:
        assert sum(line.startswith(f"| {name} ") for line in lines) == 4, (name, report)

    # Each proxy against nginx round by round, printed under each case's table.
    rounds = doc["settings"]["rounds"]
    for case in doc["cases"]:
        ratios = doc["paired_ratios"][case]
        assert set(ratios) == set(PROXIES) - {"nginx"}, (case, report)
        for name, by_key in ratios.items():
            assert len(by_key["rps"]) == rounds, (case, name, report)
            assert all(r > 0 for r in by_key["cpu_us_per_req"]), (case, name, report)
        for run in doc["cases"][case]["aiproxy"]["rounds"]:
            assert run["steal_pct"] >= 0, (case, report)
    assert sum(line.startswith("ratio to nginx in the same round") for line in lines) == 3, report
    assert sum(line.startswith("  aiproxy: req/s ") for line in lines) == 3, report
