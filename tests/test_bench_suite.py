"""The micro benchmark suite (bench/, `make bench`) runs against the code as it is.

Each benchmark once and untimed (--benchmark-disable): speed is for `make bench` to
compare, this only keeps the suite working. Nothing else runs it, and twice a change of
an internal signature left benchmarks broken until someone next ran `make bench`."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT


def test_every_micro_benchmark_runs() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "bench", "-m", "not slow", "--benchmark-disable",
         "-q"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
