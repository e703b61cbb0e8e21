"""Attach and detach XDP and TC programs with pyroute2 (by program fd).

Every function takes ``netns``: None for the current namespace, else the name of a
namespace under /var/run/netns (as made by `ip netns add`). Attachments outlive the
process that made them: detach explicitly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .libbpf import PROG_TYPE_XDP, BPFError, Program, prog_fd_by_id, prog_info

log = logging.getLogger("aiproxy.kernel")

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
XDP_FLAGS_REPLACE = 1 << 4
XDP_MODE_FLAGS = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}

TC_PARENTS = {"ingress": "ffff:fff2", "egress": "ffff:fff3"}
TC_PRIO = 0xA1  # our filters' preference on the clsact hooks
TC_HANDLE = 1
OUR_XDP_PROGRAMS = frozenset({"xdp_guard"})  # bpf/xdp_guard.c's program (function) name
TC_NAME = "aiproxy_tc"
NETNS_DIR = "/run/netns"  # where `ip netns add` puts its names
STATE_DIR = "/run/aiproxy"  # the XDP records' directory unless $RUNTIME_DIRECTORY names one

# The XDP programs this process attached: id -> [name, fd, interfaces]. Opening a program
# by id (BPF_PROG_GET_FD_BY_ID: its name, XDP_FLAGS_REPLACE's expected fd) takes
# CAP_SYS_ADMIN, which the systemd unit does not grant (CAP_BPF and CAP_NET_ADMIN load and
# attach): without it, what this process attached is known by its id and a dup of its fd,
# so a reload can replace it and the stop detach it.
_attached: dict[int, list] = {}


def _hold(prog: Program):
    info = prog_info(prog.fd)
    held = _attached.get(info.id)
    if held is None:
        _attached[info.id] = [info.name, os.dup(prog.fd), 1]
    else:
        held[2] += 1
    return info


# What survives this process: a record per interface of the XDP program it attached
# (id and name), in the runtime directory systemd keeps across restarts. A process that
# cannot open programs by id (no CAP_SYS_ADMIN) takes the program its killed predecessor
# left for ours when the interface still has the recorded id: ids are not reused within
# a boot. Ids recognised that way, which it may replace or detach without their fd:
_recognised: set[int] = set()
_state_warned = False


def state_dir() -> str:
    """$RUNTIME_DIRECTORY (set by systemd from RuntimeDirectory=; the first of a list),
    else /run/aiproxy."""
    return (os.environ.get("RUNTIME_DIRECTORY") or "").split(":")[0] or STATE_DIR


def _record_path(netns: str | None, ifname: str) -> str:
    # The namespace by its inode: `ip netns exec NS aiproxy` (netns None) and
    # `--netns NS` are the same interfaces, and two namespaces' "vsrv" are not. By name,
    # not index, so that a vanished interface's record can go; the index is in the record.
    where = os.path.join(NETNS_DIR, netns) if netns else "/proc/self/ns/net"
    return os.path.join(state_dir(), f"xdp.{os.stat(where).st_ino}.{ifname}")


def _state_failed(what: str, exc: OSError) -> None:
    global _state_warned
    if not _state_warned:
        _state_warned = True
        log.warning("kernel: cannot %s the XDP program record in %s (%s): after a "
                    "crash, a start without CAP_SYS_ADMIN will take the xdp_guard still "
                    "there for another tool's", what, state_dir(), exc)


def _record(netns: str | None, index: int, ifname: str, prog_id: int, name: str) -> None:
    try:
        path = _record_path(netns, ifname)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"netns": netns, "ifindex": index, "ifname": ifname,
                       "prog_id": prog_id, "prog_name": name}, f)
        os.replace(tmp, path)
    except OSError as exc:
        _state_failed("write", exc)


def _forget(netns: str | None, ifname: str) -> None:
    try:
        os.unlink(_record_path(netns, ifname))
    except FileNotFoundError:
        pass
    except OSError as exc:
        _state_failed("remove", exc)


def _recorded(netns: str | None, index: int, ifname: str) -> tuple[int, str] | None:
    """(prog id, name) recorded for the interface, if a record by us or root says so."""
    try:
        with open(_record_path(netns, ifname)) as f:
            if os.fstat(f.fileno()).st_uid not in (0, os.geteuid()):
                return None
            rec = json.load(f)
        if rec["ifindex"] != index:  # another interface of that name since
            return None
        return int(rec["prog_id"]), str(rec["prog_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _release(prog_id: int) -> None:
    held = _attached.get(prog_id)
    if held is not None:
        held[2] -= 1
        if held[2] <= 0:
            os.close(held[1])
            del _attached[prog_id]


def forget_xdp(prog_id: int) -> None:
    """An interface that went away took its attachment of ``prog_id`` with it: drop the
    hold (its fd would keep the program loaded as long as this process lives)."""
    _release(prog_id)


def _open_prog(prog_id: int) -> int:
    """A new fd for ``prog_id``: by id, or without CAP_SYS_ADMIN a dup of the one held."""
    try:
        return prog_fd_by_id(prog_id)
    except BPFError as exc:
        held = _attached.get(prog_id)
        if exc.errno != errno.EPERM or held is None:
            raise
        return os.dup(held[1])


class AttachError(BPFError):
    pass


@contextmanager
def iproute(netns: str | None = None) -> Iterator:
    try:
        from pyroute2 import IPRoute
    except ImportError as exc:  # pragma: no cover - a runtime dependency
        raise AttachError(f"pyroute2 is not installed: {exc}") from None
    # pyroute2 creates a namespace it cannot find (O_CREAT): a mistyped name would
    # silently make an empty one, and every interface in it would be "missing".
    check_netns(netns)
    try:
        ipr = IPRoute(netns=netns, flags=0) if netns else IPRoute()
    except Exception as exc:
        where = f"network namespace {netns!r}" if netns else "netlink"
        raise AttachError(f"cannot open {where}: {exc}") from None
    try:
        yield ipr
    finally:
        ipr.close()


def check_netns(netns: str | None) -> None:
    """AttachError unless ``netns`` (an `ip netns` name) exists; None is the current one."""
    if netns is not None and not os.path.exists(os.path.join(NETNS_DIR, netns)):
        raise AttachError(f"no network namespace {netns!r} (see `ip netns list`)",
                          errno.ENOENT)


def _index(ipr, ifname: str, netns: str | None) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        where = f" in netns {netns}" if netns else ""
        raise AttachError(f"no interface {ifname!r}{where}", errno.ENODEV)
    return found[0]


def interface_index(ifname: str, netns: str | None = None) -> int:
    """The index of ``ifname``; AttachError (errno ENODEV) naming the config key if there
    is no such interface."""
    with iproute(netns) as ipr:
        found = ipr.link_lookup(ifname=ifname)
    if not found:
        where = f" in netns {netns}" if netns else ""
        raise AttachError(f"no interface {ifname!r}{where} ([kernel] interfaces)",
                          errno.ENODEV)
    return found[0]


def _netlink_errno(exc: Exception) -> int:
    code = getattr(exc, "code", 0) or 0
    return abs(code)


# -- XDP --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XdpProgram:
    """The XDP program attached to an interface; ``ours`` when it is aiproxy's."""

    id: int
    name: str
    mode: str
    ours: bool

    def __str__(self) -> str:
        return f"{self.name or '?'!r} (id {self.id}, {self.mode})"


def attach_xdp(ifname: str, prog: Program, mode: str = "auto", netns: str | None = None) -> str:
    """Attach ``prog`` at XDP on ``ifname``; returns the mode used ("native"/"generic").

    "auto" tries native (driver) mode and falls back to generic (SKB) mode. An aiproxy
    program already there is replaced atomically (no packet goes unfiltered); another
    program is left alone and AttachError (EEXIST) says so, as `ip link set xdp` does
    without -force.
    """
    modes = ["native", "generic"] if mode == "auto" else [mode]
    if any(m not in XDP_MODE_FLAGS for m in modes):
        raise AttachError(f"unknown XDP mode {mode!r} (native, generic, auto)")
    errors = []
    with iproute(netns) as ipr:
        index = _index(ipr, ifname, netns)
        current = _xdp_program(ipr, index, netns, ifname)
        if current is not None and not current.ours:
            raise AttachError(foreign_message(ifname, current, "cannot attach xdp_guard"),
                              errno.EEXIST)
        if current is not None and current.mode in modes:
            modes.sort(key=lambda m: m != current.mode)  # replace in place first
        for m in modes:
            try:
                if current is None:
                    # NOEXIST: a program attached by someone else meanwhile stays.
                    _xdp_set(ipr, index, prog.fd, XDP_MODE_FLAGS[m] | XDP_FLAGS_UPDATE_IF_NOEXIST)
                elif current.mode == m:
                    _xdp_set(ipr, index, prog.fd, XDP_MODE_FLAGS[m], expect=current.id)
                else:
                    # One XDP program per interface: ours in the other mode goes first.
                    _xdp_set(ipr, index, -1, XDP_MODE_FLAGS[current.mode], expect=current.id)
                    _release(current.id)
                    current = None
                    _xdp_set(ipr, index, prog.fd, XDP_MODE_FLAGS[m] | XDP_FLAGS_UPDATE_IF_NOEXIST)
            except Exception as exc:  # NetlinkError, BPFError
                errors.append(f"{m}: {exc}")
                continue
            info = _hold(prog)
            if current is not None:
                _release(current.id)
            _record(netns, index, ifname, info.id, info.name)
            return m
    raise AttachError(f"cannot attach XDP program {prog.name} to {ifname}: " + "; ".join(errors))


def detach_xdp(ifname: str, netns: str | None = None) -> XdpProgram | None:
    """Remove aiproxy's XDP program from ``ifname``. Returns the program that was there
    (None: none); one that is not aiproxy's (``ours`` False) is left attached."""
    with iproute(netns) as ipr:
        try:
            index = _index(ipr, ifname, netns)
        except AttachError:
            _forget(netns, ifname)  # the interface is gone, and its programs with it
            raise
        current = _xdp_program(ipr, index, netns, ifname)
        if current is not None and current.ours:
            try:
                _xdp_set(ipr, index, -1, XDP_MODE_FLAGS[current.mode], expect=current.id)
            except Exception as exc:  # NetlinkError, BPFError
                raise AttachError(f"cannot detach XDP program {current} from {ifname}: {exc}",
                                  _netlink_errno(exc) or getattr(exc, "errno", 0)) from None
            _release(current.id)
        _forget(netns, ifname)  # ours is gone, or was replaced by another's
        return current


def xdp_program(ifname: str, netns: str | None = None) -> XdpProgram | None:
    """The XDP program attached to ``ifname`` (None: none)."""
    with iproute(netns) as ipr:
        return _xdp_program(ipr, _index(ipr, ifname, netns), netns, ifname)


def xdp_state(ifname: str, netns: str | None = None) -> dict:
    """{"mode": "native"|"generic"|None, "prog_id": int|None}"""
    with iproute(netns) as ipr:
        return _xdp_state(ipr, _index(ipr, ifname, netns))


def foreign_message(ifname: str, prog: XdpProgram, what: str) -> str:
    off = {"native": "xdpdrv", "generic": "xdpgeneric"}.get(prog.mode, "xdp")
    return (f"{what} on {ifname}: the XDP program there, {prog}, is not aiproxy's and is "
            f"not replaced (if it should go: ip link set dev {ifname} {off} off)")


def _xdp_program(ipr, index: int, netns: str | None, ifname: str) -> XdpProgram | None:
    state = _xdp_state(ipr, index)
    if not state["mode"] or not state["prog_id"]:
        return None
    prog_id = state["prog_id"]
    try:
        fd = _open_prog(prog_id)
    except BPFError as exc:  # replaced meanwhile, or not ours to name: not touched
        rec = _recorded(netns, index, ifname) if exc.errno == errno.EPERM else None
        if rec is None or rec[0] != prog_id or rec[1] not in OUR_XDP_PROGRAMS \
                or state["mode"] not in XDP_MODE_FLAGS:
            return XdpProgram(prog_id, "", state["mode"], False)
        _recognised.add(prog_id)
        return XdpProgram(prog_id, rec[1], state["mode"], True)
    try:
        info = prog_info(fd)
    finally:
        os.close(fd)
    # The program name is what the kernel keeps of the C function's name; together with
    # the type it tells aiproxy's program from another (a mode this code does not
    # manage, e.g. offloaded, is never taken for ours).
    ours = (info.type == PROG_TYPE_XDP and info.name in OUR_XDP_PROGRAMS
            and state["mode"] in XDP_MODE_FLAGS)
    return XdpProgram(state["prog_id"], info.name, state["mode"], ours)


def _xdp_set(ipr, index: int, fd: int, flags: int, expect: int | None = None) -> None:
    """Set (fd) or clear (-1) the XDP program; with ``expect`` (a program id) only if
    that program is the one attached (XDP_FLAGS_REPLACE: atomic, EEXIST otherwise)."""
    attrs = [["IFLA_XDP_FD", fd]]
    if expect is None:
        attrs.append(["IFLA_XDP_FLAGS", flags])
        ipr.link("set", index=index, xdp={"attrs": attrs})
        return
    try:
        expected = _open_prog(expect)
    except BPFError as exc:
        if exc.errno != errno.EPERM or expect not in _recognised:
            raise
        # A predecessor's program, known by its record: its fd is out of reach, so no
        # XDP_FLAGS_REPLACE. Set without UPDATE_IF_NOEXIST replaces whatever is there,
        # checked just before to be that id.
        if _xdp_state(ipr, index)["prog_id"] != expect:
            raise AttachError(f"XDP program id {expect} was replaced meanwhile",
                              errno.EEXIST) from None
        ipr.link("set", index=index, xdp={"attrs": attrs + [["IFLA_XDP_FLAGS", flags]]})
        return
    try:
        attrs += [["IFLA_XDP_FLAGS", flags | XDP_FLAGS_REPLACE],
                  ["IFLA_XDP_EXPECTED_FD", expected]]
        ipr.link("set", index=index, xdp={"attrs": attrs})
    finally:
        os.close(expected)


def _xdp_state(ipr, index: int) -> dict:
    link = ipr.link("get", index=index)[0]
    xdp = link.get_attr("IFLA_XDP")
    state: dict = {"mode": None, "prog_id": None}
    if xdp is None:
        return state
    attached = xdp.get_attr("IFLA_XDP_ATTACHED")
    state["mode"] = {"xdp": "native", "xdpgeneric": "generic", "drv": "native",
                     "skb": "generic", 1: "native", 2: "generic"}.get(attached)
    if attached not in (None, "none", 0) and state["mode"] is None:
        state["mode"] = str(attached)
    state["prog_id"] = xdp.get_attr("IFLA_XDP_PROG_ID")
    return state


# -- TC ---------------------------------------------------------------------------------


def attach_tc(ifname: str, prog: Program, direction: str, netns: str | None = None) -> None:
    """Attach ``prog`` as a direct-action bpf filter on the clsact ``direction`` hook.

    Adds the clsact qdisc if missing; replaces our own filter if one is there.
    """
    parent = TC_PARENTS[direction]
    with iproute(netns) as ipr:
        index = _index(ipr, ifname, netns)
        if not _has_clsact(ipr, index):
            try:
                ipr.tc("add", "clsact", index)
            except Exception as exc:
                if _netlink_errno(exc) != errno.EEXIST:
                    raise AttachError(f"cannot add clsact on {ifname}: {exc}") from None
        try:
            ipr.tc("replace-filter", "bpf", index, TC_HANDLE, fd=prog.fd, name=TC_NAME,
                   parent=parent, classid=1, direct_action=True, prio=TC_PRIO)
        except Exception as exc:
            raise AttachError(
                f"cannot attach TC program {prog.name} to {ifname} {direction}: {exc}") from None


def detach_tc(ifname: str, direction: str, netns: str | None = None) -> bool:
    """Remove our filter from ``direction``; drops clsact when nothing else uses it."""
    parent = TC_PARENTS[direction]
    with iproute(netns) as ipr:
        index = _index(ipr, ifname, netns)
        if not _has_clsact(ipr, index) or not _our_filters(ipr, index, parent):
            return False
        ipr.tc("del-filter", "bpf", index, TC_HANDLE, parent=parent, prio=TC_PRIO)
        if not any(_filters(ipr, index, p) for p in TC_PARENTS.values()):
            try:
                ipr.tc("del", "clsact", index)
            except Exception:
                pass
        return True


def tc_state(ifname: str, netns: str | None = None) -> dict[str, bool]:
    """{"ingress": attached?, "egress": attached?} for our filter."""
    with iproute(netns) as ipr:
        index = _index(ipr, ifname, netns)
        if not _has_clsact(ipr, index):
            return dict.fromkeys(TC_PARENTS, False)
        return {d: bool(_our_filters(ipr, index, p)) for d, p in TC_PARENTS.items()}


def _has_clsact(ipr, index: int) -> bool:
    return any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(index))


def _filters(ipr, index: int, parent: str) -> list:
    return [f for f in ipr.get_filters(index, parent=parent) if f.get_attr("TCA_OPTIONS")]


def _our_filters(ipr, index: int, parent: str) -> list:
    return [f for f in _filters(ipr, index, parent)
            if (f["info"] >> 16) == TC_PRIO
            and f.get_attr("TCA_OPTIONS").get_attr("TCA_BPF_NAME") == TC_NAME]


@dataclass(frozen=True, slots=True)
class InterfaceState:
    ifname: str
    netns: str | None
    xdp_mode: str | None
    xdp_prog_id: int | None
    tc_ingress: bool
    tc_egress: bool


def interface_state(ifname: str, netns: str | None = None) -> InterfaceState:
    xdp = xdp_state(ifname, netns)
    tc = tc_state(ifname, netns)
    return InterfaceState(ifname, netns, xdp["mode"], xdp["prog_id"], tc["ingress"],
                          tc["egress"])
