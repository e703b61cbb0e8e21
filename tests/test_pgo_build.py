"""`scripts/pgo_build.sh` on a copy of this tree: the three steps run, the training run
leaves counters, the extensions come out built with them, and the proxy built that way
serves the training traffic (pgo_train.py fails when it does not).

Slow (two builds of every extension), so `make test` leaves it out:
`python -m pytest tests/test_pgo_build.py -m slow`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT


def _gcc() -> bool:
    import sysconfig

    cc = sysconfig.get_config_var("CC").split()[0]
    out = subprocess.run([cc, "--version"], capture_output=True, text=True)
    return "Free Software Foundation" in out.stdout


def _producer_flags(so: Path) -> str:
    """The command line GCC recorded in the module's debug info (built with -g)."""
    out = subprocess.run(["readelf", "--debug-dump=info", str(so)], capture_output=True,
                         text=True)
    return "\n".join(line for line in out.stdout.splitlines() if "DW_AT_producer" in line)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pgo_build_trains_and_builds_with_the_profile(tmp_path: Path) -> None:
    if not _gcc():
        pytest.skip("the compiler is not GCC (pgo_build.sh supports GCC's profiles only)")
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is needed to read the build flags back")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO_ROOT, capture_output=True, check=True).stdout.split(b"\0")
    tree = tmp_path / "tree"
    for name in filter(None, (f.decode() for f in files)):
        src = REPO_ROOT / name
        if src.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name)
    env = {**os.environ, "PYTHON": sys.executable, "PGO_SCALE": "2", "AIPROXY_BPF": "0"}
    proc = subprocess.run(["bash", "scripts/pgo_build.sh"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "pgo training: responses by status" in proc.stdout, proc.stdout[-3000:]
    gcda = list((tree / "build" / "pgo-profile").glob("*.gcda"))
    assert any("h1_upstream" in p.name for p in gcda), [p.name for p in gcda]

    h1 = next((tree / "aiproxy" / "_fast").glob("h1.*.so"))
    flags = _producer_flags(h1)
    assert "-fprofile-use=" in flags and "-fprofile-generate" not in flags, flags
    # The module with ifunc resolvers is left out of both steps (see setup.py PGO_SKIP).
    head = next((tree / "aiproxy" / "_fast").glob("intent_head.*.so"))
    assert "-fprofile" not in _producer_flags(head)

    # The tree built this way serves again (a second, short training run: it checks the
    # status of every response and the proxy's log).
    again = subprocess.run([sys.executable, "scripts/pgo_train.py", "1"], cwd=tree,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
