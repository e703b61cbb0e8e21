"""The kernel fast paths of one proxy process, driven by the server's lifecycle.

    kernel = ProxyKernel(config.source)
    kernel.start(config.kernel, policy_cidrs)  # load + attach; KernelStartError if that fails
    kernel.reload(new.kernel)        # maps in place, no detach; KernelStartError (old
                                     # state kept) if the new [kernel] cannot be applied
    kernel.splice_tunnel(loop, down_transport, up_transport)   # per Upgrade tunnel
    kernel.want_policy_cidrs(cidrs)  # on the loop: True when the deny map must change,
    kernel.apply_policy_cidrs()      # then this in a thread
    kernel.stop()                    # detach everything, unload

With ``pin_dir`` (worker 0 under a supervisor: proxy_pin_dir(supervisor pid)) the XDP/TC
maps are pinned in bpffs, so a restarted worker 0 takes over the deny list, counters
and rate buckets of the one that died, and replaces its still-attached programs in
place. stop() removes the pins; release_orphaned() is the supervisor's clean-up when
worker 0 could not stop itself.

XDP/TC (``interfaces``) are an explicit request: failing to load or attach them is an
error at start. ``splice_tunnels`` is an optimisation: when the kernel path is not
available (not root, bpf() refused, objects not built) or cannot apply (a TLS
connection), tunnels are copied in user space and the reason is logged once.

[policy] deny rules on source CIDRs alone (governance.policy.kernel_deny_cidrs) join
[kernel] deny_cidrs in the XDP deny map; they change with the policy files, without a
config reload. Map changes run in threads, serialised by one lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiproxy.config.schema import KernelConfig

from .libbpf import BPFError, BPFPinError

if TYPE_CHECKING:
    from .manager import KernelFastPaths
    from .splice import Splicer
    from .tunnel import HangupWatch, TunnelSplice

log = logging.getLogger("aiproxy.kernel")


PIN_ROOT = "/sys/fs/bpf/aiproxy"  # manager.PIN_ROOT (not imported: the supervisor stays light)


def proxy_pin_dir(owner_pid: int) -> str:
    """Where worker 0 of the proxy supervised by ``owner_pid`` pins its maps."""
    return os.path.join(PIN_ROOT, f"proxy-{owner_pid}")


def running_proxies(netns: str | None = None) -> dict[int, str]:
    """Supervisor pid -> its pin directory, as this process can open it, for every live
    proxy whose worker 0 pinned its maps (only those in network namespace ``netns``, an
    ``ip netns`` name, when given). The path goes through /proc/<pid>/root: a proxy
    started by ``ip netns exec`` has a private /sys, its bpffs is only visible there."""
    want = None
    if netns is not None:
        try:
            st = os.stat(os.path.join("/run/netns", netns))
        except OSError:
            return {}
        want = (st.st_dev, st.st_ino)
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        path = f"/proc/{name}/root{proxy_pin_dir(int(name))}"
        try:
            if not os.path.isdir(path):
                continue
            if want is not None:
                st = os.stat(f"/proc/{name}/ns/net")
                if (st.st_dev, st.st_ino) != want:
                    continue
        except OSError:  # gone meanwhile, or not ours to look into
            continue
        out[int(name)] = path
    return dict(sorted(out.items()))


def release_orphaned(interfaces: Iterable[str], pin_dir: str) -> bool:
    """After every worker has exited: if ``pin_dir`` is still there, worker 0 died
    without detaching (SIGKILL), so detach XDP/TC from ``interfaces`` and drop the
    pins. True when there was something to clean up."""
    if not os.path.isdir(pin_dir):
        return False
    from . import attach
    from .manager import remove_pins

    interfaces = sorted(interfaces)
    for ifname in interfaces:
        try:
            there = attach.detach_xdp(ifname)
            if there is not None and not there.ours:
                log.warning("kernel: %s: XDP program %s is not aiproxy's; left attached",
                            ifname, there)
            for direction in attach.TC_PARENTS:
                attach.detach_tc(ifname, direction)
        except BPFError as exc:
            log.warning("kernel: detaching what worker 0 left on %s: %s", ifname, exc)
    remove_pins(pin_dir)
    log.info("kernel: detached what worker 0 left attached on %s",
             ", ".join(interfaces) or "no interface")
    return True


def remove_stale_pins() -> None:
    """Drop pin directories of supervisors that are gone (killed without a stop)."""
    try:
        names = os.listdir(PIN_ROOT)
    except OSError:
        return
    from .manager import remove_pins

    for name in names:
        pid = name.removeprefix("proxy-")
        if name.startswith("proxy-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_pins(os.path.join(PIN_ROOT, name))


class KernelStartError(Exception):
    """The configured kernel fast paths cannot be loaded or attached (message says why:
    the program, the interface, the verifier log)."""


class ProxyKernel:
    def __init__(self, source: str = "", pin_dir: str | None = None) -> None:
        self.source = source
        self.pin_dir = pin_dir  # maps pinned here (worker 0 under a supervisor)
        self.cfg = KernelConfig()
        self.fast: KernelFastPaths | None = None
        self.splicer: Splicer | None = None
        self.splice_on = False  # splice_tunnels configured and the kernel path works
        self.tunnels_spliced = 0
        self.tunnels_copied = 0
        self.spliced_bytes = 0  # of released tunnels; live ones are read from the map
        self.watch: HangupWatch | None = None
        self._told: set[str] = set()
        self.policy_cidrs: tuple[str, ...] = ()  # in the deny map now
        self.policy_wanted: tuple[str, ...] = ()  # set on the event loop
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def start(self, cfg: KernelConfig, policy_cidrs: tuple[str, ...] = ()) -> None:
        with self._lock:
            self.cfg = cfg
            self.policy_cidrs = self.policy_wanted = tuple(policy_cidrs)
            if cfg.interfaces:
                self.fast = self._start_fast(self._with_policy(cfg))
        self._set_splice(cfg.splice_tunnels)

    def reload(self, cfg: KernelConfig) -> None:
        """Apply a new [kernel]: on failure the running programs and maps stay as they
        were and KernelStartError says why."""
        with self._lock:
            old, fast = self.cfg, self.fast
            if cfg.interfaces and fast is None:
                self.fast = self._start_fast(self._with_policy(cfg))
            elif fast is not None and not cfg.interfaces:
                fast.stop()
                self.fast = None
                self._unpin()
            elif fast is not None:
                try:
                    fast.reload(self._with_policy(cfg))
                except (BPFError, ValueError) as exc:
                    try:
                        fast.reload(self._with_policy(old))
                    except (BPFError, ValueError) as again:
                        log.error("kernel: restoring the previous [kernel] failed too: %s",
                                  again)
                    raise KernelStartError(f"{self.source}: [kernel]: {exc}") from None
            self.cfg = cfg
        self._set_splice(cfg.splice_tunnels)

    def want_policy_cidrs(self, cidrs: tuple[str, ...]) -> bool:
        """Record the policy's deny CIDRs (on the event loop); True when they differ
        from the last wanted, i.e. apply_policy_cidrs should run (in a thread)."""
        cidrs = tuple(cidrs)
        if cidrs == self.policy_wanted:
            return False
        self.policy_wanted = cidrs
        return True

    def apply_policy_cidrs(self) -> None:
        """Bring the deny map to the latest wanted policy CIDRs (whichever call runs
        last applies the newest). Errors are logged; the map keeps its entries."""
        with self._lock:
            cidrs = self.policy_wanted
            if cidrs == self.policy_cidrs:
                return
            old, self.policy_cidrs = self.policy_cidrs, cidrs
            if self.fast is None:
                return
            try:
                self.fast.reload(self._with_policy(self.cfg))
            except (BPFError, ValueError) as exc:
                self.policy_cidrs = old
                log.error("kernel: policy deny CIDRs not applied to the XDP deny map: %s", exc)
                return
        log.info("kernel: policy deny CIDRs in the XDP deny map: %s", ", ".join(cidrs) or "none")

    def _with_policy(self, cfg: KernelConfig) -> KernelConfig:
        if not self.policy_cidrs:
            return cfg
        return dataclasses.replace(cfg, deny_cidrs=tuple(dict.fromkeys(
            cfg.deny_cidrs + self.policy_cidrs)))

    def stop(self) -> None:
        with self._lock:
            if self.fast is not None:
                self.fast.stop()
                self.fast = None
            self._unpin()
        if self.splicer is not None:
            self.splicer.close()
            self.splicer = None
        self.splice_on = False
        if self.watch is not None:
            watch, self.watch = self.watch, None
            if watch.loop is not None:
                watch.loop.call_soon_threadsafe(watch.close)
            else:
                watch.close()

    def _unpin(self) -> None:
        if self.pin_dir is not None:
            from .manager import remove_pins

            remove_pins(self.pin_dir)

    def _start_fast(self, cfg: KernelConfig) -> KernelFastPaths:
        from .manager import KernelFastPaths

        fast = KernelFastPaths(cfg, pin_dir=self.pin_dir)
        try:
            attached = fast.start()
        except BPFPinError as exc:
            raise KernelStartError(self._pin_problem(exc)) from None
        except (BPFError, ValueError) as exc:
            raise KernelStartError(f"{self.source}: [kernel]: {exc}") from None
        for ifname, what in attached.items():
            log.info("kernel: %s: xdp_guard (%s)%s", ifname, what.get("xdp"),
                     ", tc_classify ingress+egress" if what.get("tc") else "")
        return fast

    def _pin_problem(self, exc: BPFPinError) -> str:
        """FILE:LINE: kernel.interfaces: why worker 0 cannot pin (a service user that may
        not write in bpffs: systemd mounts /sys/fs/bpf mode 0700 for root)."""
        from aiproxy.config.errors import Problem
        from aiproxy.config.loader import read_config_text
        from aiproxy.config.locate import Locator

        try:
            line = Locator(read_config_text(self.source)).line(("kernel", "interfaces"))
        except Exception:  # noqa: BLE001 - a config given as text: no lines to name
            line = 0
        return str(Problem(self.source, line, "kernel.interfaces",
                           f"{exc} (with workers > 1, worker 0 pins the XDP/TC maps in "
                           "bpffs so that its restart keeps them: run as a user that may "
                           "write there, or with workers = 1, which pins nothing)"))

    def _set_splice(self, wanted: bool) -> None:
        if not wanted:
            self.splice_on = False
            return
        if self.splicer is None:
            from .splice import Splicer

            self.splicer = Splicer()
        self.splice_on = self.splicer.available()
        if self.splice_on and self.watch is None:
            from .tunnel import HangupWatch

            self.watch = HangupWatch()
        if not self.splice_on:
            self._tell("unavailable", "kernel: splice_tunnels: the kernel path is unavailable "
                       f"({self.splicer.reason}); tunnels are copied in user space")

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("%s", message)

    # -- tunnels ---------------------------------------------------------------------

    def splice_tunnel(self, loop: asyncio.AbstractEventLoop, down: asyncio.Transport,
                      up: asyncio.Transport) -> TunnelSplice | None:
        """Start splicing a tunnel whose 101 has just been forwarded; None when it stays
        on the copy path."""
        if not self.splice_on:
            self.tunnels_copied += 1
            return None
        if down.get_extra_info("sslcontext") is not None or (
                up.get_extra_info("sslcontext") is not None):
            self._tell("tls", "kernel: splice_tunnels: tunnels over TLS are copied in user "
                       "space (the kernel cannot splice encrypted streams)")
            self.tunnels_copied += 1
            return None
        from .tunnel import TunnelSplice

        return TunnelSplice(self, loop, down, up)

    def splice_failed(self, exc: Exception) -> None:
        self._tell("failed", f"kernel: splicing a tunnel failed ({exc}); copying it in user "
                   "space (logged once)")

    # -- read back (metrics) ---------------------------------------------------------

    def counters(self) -> dict[str, dict]:
        """XDP/TC counters from the maps (empty when not attached)."""
        return self.fast.counters() if self.fast is not None else {}

    def attached(self) -> dict[str, dict]:
        return dict(self.fast.attached) if self.fast is not None else {}

    def splice_stats(self) -> dict[str, int]:
        live = active = 0
        if self.splicer is not None:
            active = self.splicer.active
            for pair in self.splicer.pairs():
                ab, ba = self.splicer.redirected(pair)
                live += ab + ba
        return {"spliced": self.tunnels_spliced, "copied": self.tunnels_copied,
                "bytes": self.spliced_bytes + live, "active": active}


__all__ = ["ProxyKernel", "KernelStartError", "proxy_pin_dir", "release_orphaned",
           "remove_stale_pins"]
