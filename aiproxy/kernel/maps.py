"""Config -> BPF maps, in place: a reload changes map contents, never the attachment.

Each ``sync`` computes the wanted contents, adds what is missing first, then removes
what is no longer wanted, so a packet never sees a state that is less strict than both
the old and the new config would be for entries present in both.
"""

from __future__ import annotations

import functools
import gzip
import ipaddress
import os
import time
from collections.abc import Iterable, Sequence

from aiproxy.config.schema import KernelConfig, TrafficClass

from . import deny
from .libbpf import BpfObject, Map
from .structs import (
    CLASS_SET_DSCP,
    CLASS_SET_PRIORITY,
    CLASSIFY_MAX_CLASSES,
    GUARD_COUNTER_NAMES,
    SIGNATURES,
    ClassInfo,
    ClassStats,
    GuardSettings,
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

GUARD_MAPS = (*deny.DENY_MAPS, "guard_ports", "guard_settings", "guard_counters")
CLASSIFY_MAPS = ("class_ports", "class_sigs", "class_info", "class_stats")


KNOWN_HZ = (100, 250, 300, 1000)


@functools.cache
def jiffy_ns() -> int:
    """Nanoseconds per jiffy of the running kernel (1e9 / CONFIG_HZ), 0 if unknown.

    From the kernel config when it is published, else measured from two readings of
    /proc/timer_list (jiffies and the clock) 50 ms apart, rounded to a known HZ."""
    hz = _config_hz()
    if hz is None:
        try:
            (j0, t0), _, (j1, t1) = _timer_list(), time.sleep(0.05), _timer_list()
            rate = (j1 - j0) * 1e9 / (t1 - t0)
            hz = min(KNOWN_HZ, key=lambda h: abs(h - rate))
            if abs(hz - rate) > hz * 0.1:
                hz = None
        except (OSError, ValueError, ZeroDivisionError):
            hz = None
    return 1_000_000_000 // hz if hz else 0


def _config_hz() -> int | None:
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as fh:
                for line in fh:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except (OSError, ValueError):
            continue
    return None


def _timer_list() -> tuple[int, int]:
    now = jiffies = None
    with open("/proc/timer_list") as fh:
        for line in fh:
            if now is None and line.startswith("now at "):
                now = int(line.split()[2])
            elif line.startswith("jiffies: "):
                jiffies = int(line.split()[1])
                break
    if now is None or jiffies is None:
        raise ValueError("no clock in /proc/timer_list")
    return jiffies, now


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def _u16(value: int) -> bytes:
    return value.to_bytes(2, "little")


def _u64(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")


def _sync_set(m: Map, wanted: dict[bytes, bytes]) -> tuple[int, int]:
    """Make ``m`` hold exactly ``wanted``; returns (added or changed, removed)."""
    # Membership from key iteration, not lookup: an LPM trie lookup matches prefixes,
    # so a new /32 inside an old /16 would look present.
    existing = set(m.keys())
    changed = 0
    for key, value in wanted.items():
        if key not in existing or m.lookup(key) != value:
            m.update(key, value)
            changed += 1
    removed = 0
    for key in existing:
        if key not in wanted:
            m.delete(key)
            removed += 1
    return changed, removed


def _percpu_sum(values: Sequence[bytes] | None, offset: int = 0) -> int:
    if not values:
        return 0
    return sum(int.from_bytes(v[offset:offset + 8], "little") for v in values)


class GuardMaps:
    """xdp_guard's maps: deny list (aiproxy.kernel.deny), SYN ports and rate, counters."""

    def __init__(self, maps: dict[str, Map]) -> None:
        missing = [name for name in GUARD_MAPS if name not in maps]
        if missing:
            raise KeyError(f"xdp_guard maps missing: {', '.join(missing)}")
        self.maps = maps

    @classmethod
    def of(cls, obj: BpfObject) -> GuardMaps:
        return cls(obj.maps)

    def sync(self, cfg: KernelConfig) -> dict[str, int]:
        nets = [ipaddress.ip_network(text) for text in cfg.deny_cidrs]
        return {
            **self.set_deny(nets),
            **self.set_syn_limit(cfg.syn_rate_per_source, cfg.syn_burst, cfg.syn_ports),
        }

    def set_deny(self, nets: Iterable[Network]) -> dict[str, int]:
        return deny.apply(self.maps, nets)

    def set_syn_limit(self, rate: int, burst: int, ports: Iterable[int]) -> dict[str, int]:
        ports = sorted(set(ports)) if rate else []
        words: dict[int, int] = {}
        for port in ports:
            words[port >> 6] = words.get(port >> 6, 0) | (1 << (port & 63))
        bitmap = self.maps["guard_ports"]
        for i in range(bitmap.max_entries):  # 1024 words; only changed ones are written
            raw = bitmap.lookup(_u32(i))
            want = words.get(i, 0).to_bytes(8, "little")
            if raw != want:
                bitmap.update(_u32(i), want)
        settings = GuardSettings(rate, max(burst or rate, 1) if rate else 0, jiffy_ns())
        self.maps["guard_settings"].update(_u32(0), bytes(settings))
        return {"syn_ports": len(ports), "syn_rate": rate}

    def counters(self) -> dict[str, int]:
        m = self.maps["guard_counters"]
        return {name: _percpu_sum(m.lookup_percpu(_u32(i)))
                for i, name in enumerate(GUARD_COUNTER_NAMES)}

    def reset_counters(self) -> None:
        m = self.maps["guard_counters"]
        for i in range(len(GUARD_COUNTER_NAMES)):
            m.update(_u32(i), [b"\0" * 8] * m.ncpus)


class ClassifyMaps:
    """tc_classify's maps: port -> class, payload signature -> class, marks, stats."""

    def __init__(self, maps: dict[str, Map]) -> None:
        missing = [name for name in CLASSIFY_MAPS if name not in maps]
        if missing:
            raise KeyError(f"tc_classify maps missing: {', '.join(missing)}")
        self.maps = maps
        self.names: dict[int, str] = {0: "unclassified"}

    @classmethod
    def of(cls, obj: BpfObject) -> ClassifyMaps:
        return cls(obj.maps)

    def sync(self, classes: Sequence[TrafficClass]) -> dict[str, int]:
        if len(classes) >= CLASSIFY_MAX_CLASSES:
            raise ValueError(f"at most {CLASSIFY_MAX_CLASSES - 1} classes")
        info = self.maps["class_info"]
        # Marks first, then the lookups that lead to them.
        for cls in classes:
            flags = (CLASS_SET_PRIORITY if cls.priority is not None else 0) | (
                CLASS_SET_DSCP if cls.dscp is not None else 0)
            info.update(_u32(cls.id), bytes(ClassInfo(cls.priority or 0, cls.dscp or 0, flags)))
        wanted_ports = {_u16(port): _u32(cls.id) for cls in classes for port in cls.ports}
        _sync_set(self.maps["class_ports"], wanted_ports)
        sigs = {SIGNATURES[sig]: cls.id for cls in classes for sig in cls.payload}
        for sig in SIGNATURES.values():
            self.maps["class_sigs"].update(_u32(sig), _u32(sigs.get(sig, 0)))
        used = {cls.id for cls in classes}
        for cid in range(1, CLASSIFY_MAX_CLASSES):
            if cid not in used:
                info.update(_u32(cid), bytes(ClassInfo()))
        self.names = {0: "unclassified", **{cls.id: cls.name for cls in classes}}
        return {"classes": len(classes), "class_ports": len(wanted_ports)}

    def stats(self) -> dict[str, dict[str, int]]:
        m = self.maps["class_stats"]
        out = {}
        for cid, name in sorted(self.names.items()):
            values = m.lookup_percpu(_u32(cid))
            out[name] = {
                "packets": _percpu_sum(values, ClassStats.packets.offset),
                "bytes": _percpu_sum(values, ClassStats.bytes.offset),
            }
        return out
