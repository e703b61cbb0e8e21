"""A functional pass of `bench/semantic_e2e.py` (one short round). Slow, so `make test`
leaves it out: `python -m pytest bench -m slow`. It checks that both proxies answered
every POST and that the semantic one classified them; nothing about timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import find_tool  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "semantic_e2e.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_semantic_e2e_quick(tmp_path: Path) -> None:
    missing = [t for t in ("nginx", "wrk") if find_tool(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/bootstrap.sh --test)")
    out = tmp_path / "semantic.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--duration", "1",
                           "--prompts", "50", "--json", str(out)],
                          capture_output=True, text=True, timeout=280)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    doc = json.loads(out.read_text())
    for name in ("off", "semantic"):
        (run,) = doc["runs"][name]
        assert run["rps"] > 0 and run["errors"] == 0, (name, report)
    assert doc["semantic_decisions"] > 0, report
    assert "added CPU per request with semantic routing" in proc.stdout, report
