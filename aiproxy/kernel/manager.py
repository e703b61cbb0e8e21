"""Kernel fast paths for one config: load, attach, sync on reload, detach on stop.

    fast = KernelFastPaths(cfg.kernel)      # nothing happens yet
    fast.start()                            # load + sync maps + attach (raises BPFError)
    fast.reload(new_cfg.kernel)             # maps updated in place; no detach
    fast.counters()                         # {"xdp": {...}, "tc": {...}} for /metrics
    fast.stop()                             # detach everything it attached

With ``pin_dir`` the maps are pinned in bpffs and reused by the next load, which is how
`aiproxy bpf attach/status/detach` (separate processes) share state.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from pathlib import Path

from aiproxy.config.schema import KernelConfig

from . import attach
from .libbpf import BPFError, BpfObject, Map, object_path
from .maps import CLASSIFY_MAPS, GUARD_MAPS, ClassifyMaps, GuardMaps

log = logging.getLogger("aiproxy.kernel")

BPFFS = "/sys/fs/bpf"
PIN_ROOT = os.path.join(BPFFS, "aiproxy")


def pin_dir_for(netns: str | None) -> str:
    return os.path.join(PIN_ROOT, netns or "_host")


def ensure_bpffs() -> None:
    """Mount bpffs on /sys/fs/bpf if it is not mounted (needs root)."""
    with open("/proc/self/mounts") as fh:
        if any(line.split()[1:3] == [BPFFS, "bpf"] for line in fh):
            return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 4 + [ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(b"bpf", BPFFS.encode(), b"bpf", None, 0, None) != 0:
        err = ctypes.get_errno()
        raise BPFError(f"cannot mount bpffs on {BPFFS}: {os.strerror(err)}", err)


class KernelFastPaths:
    def __init__(self, cfg: KernelConfig, *, netns: str | None = None,
                 pin_dir: str | None = None) -> None:
        self.cfg = cfg
        self.netns = netns
        self.pin_dir = pin_dir
        self.guard_obj: BpfObject | None = None
        self.tc_obj: BpfObject | None = None
        self.guard: GuardMaps | None = None
        self.classify: ClassifyMaps | None = None
        self.attached: dict[str, dict[str, str | bool]] = {}  # ifname -> what

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> dict[str, dict]:
        """Load, sync and attach to every configured interface. On failure, undoes what
        it did and raises BPFError."""
        # Every interface first: a missing one fails before anything is loaded, pinned
        # or attached (a re-run of `aiproxy bpf attach` must not undo the last one).
        self._check_interfaces(self.cfg.interfaces)
        try:
            self._load()
            self._sync()
            for ifname in self.cfg.interfaces:
                self._attach(ifname)
        except BaseException:
            self.stop()
            raise
        return dict(self.attached)

    def reload(self, cfg: KernelConfig) -> None:
        """Apply a new config: maps in place; attach new interfaces, detach dropped ones.
        Interfaces in both configs keep their programs attached throughout."""
        self._check_interfaces(cfg.interfaces)  # before the maps change
        old = self.cfg
        self.cfg = cfg
        if (cfg.classes and self.tc_obj is None) or (cfg.interfaces and self.guard_obj is None):
            self._load()
        self._sync()
        for ifname in old.interfaces:
            if ifname not in cfg.interfaces:
                self._detach(ifname)
        for ifname in cfg.interfaces:
            if ifname not in self.attached or (
                    bool(cfg.classes) != bool(self.attached[ifname].get("tc"))):
                self._attach(ifname)
            elif lost := self._lost(ifname):
                # Deleted and re-created under the same name (the programs went with the
                # old interface), or detached by hand: attach again.
                log.warning("kernel: %s: %s; attaching again", ifname, lost)
                self._attach(ifname)

    def stop(self) -> None:
        for ifname in list(self.attached):
            try:
                self._detach(ifname)
            except BPFError as exc:
                log.warning("kernel: detach %s: %s", ifname, exc)
        for obj in (self.guard_obj, self.tc_obj):
            if obj is not None:
                obj.close()
        self.guard_obj = self.tc_obj = None
        self.guard = self.classify = None

    # -- parts -----------------------------------------------------------------------

    def _pins(self, family: str) -> str | None:
        if self.pin_dir is None:
            return None
        ensure_bpffs()
        return os.path.join(self.pin_dir, family)

    def _load(self) -> None:
        if self.cfg.interfaces and self.guard_obj is None:
            self.guard_obj = BpfObject(object_path("xdp_guard"), pin_dir=self._pins("xdp_guard"))
            self.guard = GuardMaps.of(self.guard_obj)
        if self.cfg.interfaces and self.cfg.classes and self.tc_obj is None:
            self.tc_obj = BpfObject(object_path("tc_classify"),
                                    pin_dir=self._pins("tc_classify"))
            self.classify = ClassifyMaps.of(self.tc_obj)

    def _sync(self) -> None:
        if self.guard is not None:
            log.info("kernel: xdp_guard maps %s", self.guard.sync(self.cfg))
        if self.classify is not None:
            log.info("kernel: tc_classify maps %s", self.classify.sync(self.cfg.classes))

    def _attach(self, ifname: str) -> None:
        done: dict[str, str | bool] = self.attached.setdefault(ifname, {})
        if self.guard_obj is not None:
            done["xdp"] = attach.attach_xdp(ifname, self.guard_obj.program("xdp_guard"),
                                            self.cfg.xdp_mode, self.netns)
        if self.tc_obj is not None and self.cfg.classes:
            for direction in attach.TC_PARENTS:
                attach.attach_tc(ifname, self.tc_obj.program("tc_classify"), direction,
                                 self.netns)
            done["tc"] = True
        elif done.get("tc"):
            for direction in attach.TC_PARENTS:
                attach.detach_tc(ifname, direction, self.netns)
            done["tc"] = False

    def _lost(self, ifname: str) -> str | None:
        """Why ``ifname`` no longer has the programs attached to it (None: it has)."""
        done = self.attached[ifname]
        if done.get("xdp") and self.guard_obj is not None:
            ours = self.guard_obj.program("xdp_guard").info().id
            there = attach.xdp_state(ifname, self.netns)["prog_id"]
            if there != ours:
                return (f"xdp_guard (prog id {ours}) is no longer attached "
                        f"(now: {f'prog id {there}' if there else 'none'})")
        if done.get("tc") and not all(attach.tc_state(ifname, self.netns).values()):
            return "tc_classify is no longer attached"
        return None

    def _check_interfaces(self, interfaces) -> None:
        """AttachError unless every interface exists and has no XDP program but ours:
        checked before anything is loaded, pinned or changed."""
        for ifname in interfaces:
            attach.interface_index(ifname, self.netns)
            there = attach.xdp_program(ifname, self.netns)
            if there is not None and not there.ours:
                raise attach.AttachError(attach.foreign_message(
                    ifname, there, "cannot attach xdp_guard ([kernel] interfaces)"),
                    errno.EEXIST)

    def _detach(self, ifname: str) -> None:
        done = self.attached.pop(ifname, {})
        try:
            if done.get("xdp"):
                ours = (self.guard_obj.program("xdp_guard").info().id
                        if self.guard_obj is not None else None)
                try:
                    there = attach.detach_xdp(ifname, self.netns)
                except attach.AttachError as exc:
                    if exc.errno == errno.ENODEV and ours is not None:
                        attach.forget_xdp(ours)
                    raise
                if ours is not None and (there is None or there.id != ours):
                    attach.forget_xdp(ours)  # detached or replaced by another: not ours to undo
                if there is not None and not there.ours:
                    log.warning("kernel: %s: XDP program %s is not aiproxy's (xdp_guard was "
                                "replaced); left attached", ifname, there)
            if done.get("tc"):
                for direction in attach.TC_PARENTS:
                    attach.detach_tc(ifname, direction, self.netns)
        except attach.AttachError as exc:
            if exc.errno != errno.ENODEV:
                raise
            # The interface is gone, and its programs went with it: nothing to detach.
            log.info("kernel: %s is gone; its programs went with it", ifname)

    # -- read back -------------------------------------------------------------------

    def counters(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        if self.guard is not None:
            out["xdp"] = self.guard.counters()
        if self.classify is not None:
            out["tc"] = self.classify.stats()
        return out


def pinned_counters(pin_dir: str, cfg: KernelConfig) -> dict[str, dict]:
    """Counters (and the deny list's size) from maps pinned in ``pin_dir`` by `aiproxy
    bpf attach` or a multi-worker proxy's worker 0 (empty if none)."""
    out: dict[str, dict] = {}
    for family, names, wrap in (("xdp_guard", GUARD_MAPS, GuardMaps),
                                ("tc_classify", CLASSIFY_MAPS, ClassifyMaps)):
        base = Path(pin_dir, family)
        if not all((base / name).exists() for name in names):
            continue
        maps = {name: Map.from_pin(base / name) for name in names}
        try:
            if wrap is GuardMaps:
                out["xdp"] = GuardMaps(maps).counters()
                out["deny"] = {"v4": sum(1 for _ in maps["guard_deny_v4"].keys()),
                               "v6": sum(1 for _ in maps["guard_deny_v6"].keys())}
            else:
                cm = ClassifyMaps(maps)
                cm.names = {0: "unclassified", **{c.id: c.name for c in cfg.classes}}
                out["tc"] = cm.stats()
        finally:
            for m in maps.values():
                m.close()
    return out


def remove_pins(pin_dir: str) -> None:
    if os.path.isdir(pin_dir):
        shutil.rmtree(pin_dir, ignore_errors=True)  # unlinking a pin drops its reference
