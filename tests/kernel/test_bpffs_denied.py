"""`[kernel]` with `workers` > 1 as config/aiproxy.service runs it: a system user with the
unit's capabilities, and a bpffs it may not write in (systemd mounts /sys/fs/bpf mode 0700
for root). Worker 0 cannot make its pin directory: the start must fail with a config
error, not a traceback. A real proxy in a network namespace (its own mount namespace, in
which a fresh bpffs is mounted 0700), run through setpriv as uid 65534."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import start_process, stop_process

from .conftest import VethPair
from .test_unit_capabilities import NOBODY, unit_capabilities


def test_workers_with_a_bpffs_the_user_cannot_write_fail_cleanly(veth: VethPair):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    folder = Path(tempfile.mkdtemp(prefix="aiproxy-bpffs-"))  # readable by uid 65534
    try:
        folder.chmod(0o755)
        config = folder / "aiproxy.toml"
        config.write_text("""[server]
workers = 2

[[listeners]]
name = "p"
address = "127.0.0.1:46321"

[kernel]
interfaces = ["vsrv"]
xdp_mode = "generic"
""")
        config.chmod(0o644)
        caps = unit_capabilities()
        # `ip netns exec` gives the proxy a mount namespace of its own: the 0700 bpffs
        # mounted in it is seen by nothing else.
        proc = start_process(
            ["ip", "netns", "exec", veth.srv, "sh", "-c",
             'mount -t bpf -o mode=0700 bpf /sys/fs/bpf && exec "$@"', "sh",
             "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set=-all,{caps}",
             "--no-new-privs", sys.executable, "-m", "aiproxy", "-c", str(config)])
        try:
            code = proc.wait(timeout=60)
        finally:
            log = stop_process(proc)
        assert code == 2, log
        assert "Traceback" not in log, log
        assert re.search(rf"{re.escape(str(config))}:9: kernel.interfaces: xdp_guard: cannot "
                         r"pin its maps in /sys/fs/bpf/aiproxy/proxy-\d+/xdp_guard: cannot "
                         r"create /sys/fs/bpf/aiproxy: Permission denied \(with workers > 1",
                         log), log
        assert "worker 0 (pid" in log and "exited with code 2 during startup" in log, log
    finally:
        shutil.rmtree(folder, ignore_errors=True)
