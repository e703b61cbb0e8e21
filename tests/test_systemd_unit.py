"""config/aiproxy.service against what the proxy does: its ExecReload lines run as
systemd runs them (in order, the first that fails fails the reload) against a real
proxy, and `systemd-analyze verify` where it is installed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from aiproxy.config.schema import ServerConfig
from aiproxy.server.supervisor import STOP_MARGIN
from tests.conftest import simple_config
from tests.support import REPO_ROOT, admin_block, free_port, scrape, wait_port

UNIT = REPO_ROOT / "config" / "aiproxy.service"
BINARY = "/opt/aiproxy/.venv/bin/aiproxy"
CONFIG = "/etc/aiproxy/aiproxy.toml"


def service(key: str) -> list[str]:
    """The values of `key` in [Service], in order."""
    values, section = [], None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line.startswith(f"{key}="):
            values.append(line.split("=", 1)[1])
    return values


def run_exec(key: str, config: Path, mainpid: int) -> int:
    """Run the unit's `key` commands for this checkout, config and main PID; the exit
    status of the first that fails, else 0."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for line in service(key):
        command = (line.replace(BINARY, f"{sys.executable} -m aiproxy")
                   .replace(CONFIG, str(config)).replace("$MAINPID", str(mainpid)))
        code = subprocess.run(shlex.split(command), env=env, cwd=REPO_ROOT,
                              capture_output=True, timeout=60).returncode
        if code:
            return code
    return 0


def test_systemctl_reload_fails_on_a_bad_config_and_the_proxy_keeps_serving(
        start_proxy, demo_upstream):
    """`systemctl reload` of a bad file fails (as a reload of nginx's unit after
    `nginx -t` does), so the operator sees it, and the proxy is never asked."""
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good + '\n[[routes]]\nname = "bad"\ncluster = "nope"\n')
    assert run_exec("ExecReload", proxy.config_path, proxy.proc.pid) == 2
    assert httpx.get(proxy.url + "/echo").status_code == 200
    proxy.config_path.write_text(good.replace('name = "all"', 'name = "every"'))
    assert run_exec("ExecReload", proxy.config_path, proxy.proc.pid) == 0
    deadline = time.monotonic() + 15
    while (routes := httpx.get(f"http://127.0.0.1:{admin}/config/routes").json()) \
            and routes[0]["name"] != "every":
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)
    found = scrape(admin)
    assert found[("aiproxy_config_reload_failures_total", ())] == 0
    assert found[("aiproxy_config_reloads_total", ())] == 1


def test_stop_timeout_outlasts_the_default_drain():
    """systemd SIGKILLs the control group after TimeoutStopSec: with the default
    drain_timeout_ms the supervisor must have drained and killed its stragglers first."""
    (timeout,) = service("TimeoutStopSec")
    assert int(timeout) > ServerConfig().drain_timeout_ms / 1000 + STOP_MARGIN
    assert service("KillSignal") == ["SIGTERM"] and service("KillMode") == ["mixed"]
    assert service("Type") == ["notify"] and service("NotifyAccess") == ["main"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path: Path):
    unit = tmp_path / "aiproxy.service"
    unit.write_text(UNIT.read_text().replace(BINARY, sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not re.search(r"^aiproxy\.service:", result.stderr, re.M), result.stderr
