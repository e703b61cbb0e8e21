"""The proxy with [kernel] as config/aiproxy.service runs it: a system user holding the
unit's AmbientCapabilities (CAP_BPF, CAP_NET_ADMIN ...) and not CAP_SYS_ADMIN, which
opening a BPF program by its id (BPF_PROG_GET_FD_BY_ID) takes. Real proxy processes in a
namespace made by the fixture, run through setpriv as an unprivileged uid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, process_log, start_process, stop_process

from .conftest import VethPair
from .test_attach_lifecycle import _xdp_on_vsrv

CONFIG = """
[server]
workers = 1

[[listeners]]
name = "p"
address = "127.0.0.1:46320"

[kernel]
interfaces = ["vsrv"]
xdp_mode = "generic"
deny_cidrs = ["192.0.2.0/24"]
"""

UNIT = REPO_ROOT / "config" / "aiproxy.service"
NOBODY = 65534


def unit_capabilities() -> str:
    """The unit's AmbientCapabilities in setpriv's spelling (+bpf,+net_admin,...)."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("AmbientCapabilities="):
            caps = line.split("=", 1)[1].split()
            return ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    raise AssertionError("the unit has no AmbientCapabilities")


def start_as_unit(veth: VethPair, config: Path,
                  runtime_dir: Path | None = None) -> subprocess.Popen:
    """The proxy as the unit runs it; ``runtime_dir`` is what systemd makes of the unit's
    RuntimeDirectory= (owned by the user, in $RUNTIME_DIRECTORY)."""
    caps = unit_capabilities()
    env = {"RUNTIME_DIRECTORY": str(runtime_dir)} if runtime_dir is not None else None
    return start_process(["ip", "netns", "exec", veth.srv, "setpriv", f"--reuid={NOBODY}",
                          f"--regid={NOBODY}", "--clear-groups", f"--inh-caps={caps}",
                          f"--ambient-caps={caps}", f"--bounding-set=-all,{caps}",
                          "--no-new-privs", sys.executable, "-m", "aiproxy", "-c",
                          str(config)], env=env)


def wait_log(proc: subprocess.Popen, *texts: str, timeout: float = 30) -> str:
    """The log once one of ``texts`` is in it."""
    deadline = time.monotonic() + timeout
    while not any(text in (log := process_log(proc)) for text in texts):
        assert proc.poll() is None, log
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    return log


@pytest.fixture
def config_dir():
    """A directory the unprivileged user can read (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="aiproxy-unit-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_unit_capabilities_reload_stop_and_start_again(veth: VethPair, config_dir: Path):
    # Without CAP_SYS_ADMIN the proxy could not name the XDP program it had attached
    # itself, took it for another tool's: a reload was refused ("not aiproxy's"), the
    # stop left xdp_guard attached with its deny list, and the next start refused.
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    config = config_dir / "aiproxy.toml"
    text = CONFIG
    config.write_text(text)
    config.chmod(0o644)
    for _ in range(2):  # a start after the stop takes the interface again
        proc = start_as_unit(veth, config)
        try:
            wait_log(proc, "aiproxy ready")
            assert _xdp_on_vsrv(veth)[1] == "xdp_guard"
            config.write_text(text.replace("192.0.2.0/24", "198.51.100.0/24"))
            proc.send_signal(signal.SIGHUP)
            log = wait_log(proc, "config reloaded", "reload rejected")
            assert "reload rejected" not in log, log
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, process_log(proc)
            log = process_log(proc)
            assert "left attached" not in log, log
            # No RuntimeDirectory= here, and /run/aiproxy is root's: said once, not fatal.
            assert log.count("cannot write the XDP program record") == 1, log
            assert _xdp_on_vsrv(veth) is None, log
        finally:
            stop_process(proc)
        config.write_text(text)


def test_unit_capabilities_restart_after_a_crash_takes_back_its_xdp_guard(
        veth: VethPair, config_dir: Path):
    # A SIGKILLed proxy leaves xdp_guard attached. Without CAP_SYS_ADMIN its restart could
    # not name that program, took it for another tool's and exited 2: systemd's
    # Restart=on-failure left the host without the proxy. The record in the runtime
    # directory (systemd's RuntimeDirectory=, kept across restarts) says whose it is.
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    config = config_dir / "aiproxy.toml"
    config.write_text(CONFIG)
    config.chmod(0o644)
    runtime = config_dir / "run"
    runtime.mkdir(mode=0o755)
    os.chown(runtime, NOBODY, NOBODY)
    crashed = start_as_unit(veth, config, runtime)
    try:
        wait_log(crashed, "aiproxy ready")
        left = _xdp_on_vsrv(veth)
        assert left is not None and left[1] == "xdp_guard"
        crashed.send_signal(signal.SIGKILL)
        assert crashed.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop_process(crashed)
    assert _xdp_on_vsrv(veth) == left  # the crash left it attached
    assert len(list(runtime.iterdir())) == 1
    restarted = start_as_unit(veth, config, runtime)
    try:
        log = wait_log(restarted, "aiproxy ready")
        now = _xdp_on_vsrv(veth)
        # The restart loads its own xdp_guard (new maps) and replaces the one left there.
        assert now is not None and now[1] == "xdp_guard" and now[0] != left[0], log
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(timeout=30) == 0, process_log(restarted)
        log = process_log(restarted)
        assert _xdp_on_vsrv(veth) is None, log
        assert list(runtime.iterdir()) == [], log
    finally:
        stop_process(restarted)
