"""A small ctypes binding of libbpf.so.1: open/load BPF objects, maps, test runs.

Only what aiproxy needs. Every failure becomes a :class:`BPFError` naming what failed;
a program the verifier rejects raises :class:`BPFLoadError` carrying the verifier log.
:class:`BPFUnavailable` means "no kernel fast paths here" (no libbpf, no objects built,
not root, bpf() refused): callers fall back to user space on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("aiproxy.kernel")

OBJECTS_DIR = Path(__file__).with_name("objects")
LOG_BUF_SIZE = 1 << 20

# enum bpf_map_type values this module cares about
MAP_TYPE_HASH = 1
MAP_TYPE_ARRAY = 2
MAP_TYPE_PERCPU_HASH = 5
MAP_TYPE_PERCPU_ARRAY = 6
MAP_TYPE_LRU_PERCPU_HASH = 10
MAP_TYPE_PERCPU_CGROUP_STORAGE = 21
_PERCPU_TYPES = {MAP_TYPE_PERCPU_HASH, MAP_TYPE_PERCPU_ARRAY, MAP_TYPE_LRU_PERCPU_HASH,
                 MAP_TYPE_PERCPU_CGROUP_STORAGE}

BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2

_BTF_KIND_DATASEC = 15
_LIBBPF_WARN, _LIBBPF_INFO, _LIBBPF_DEBUG = 0, 1, 2


class BPFError(Exception):
    """A libbpf or bpf() call failed."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


class BPFUnavailable(BPFError):
    """Kernel fast paths cannot run here; the caller falls back to user space."""


class BPFPinError(BPFError):
    """The pin directory cannot be made (bpffs not writable by this user)."""


class BPFLoadError(BPFError):
    """The kernel refused to load a program; ``verifier_log`` says why."""

    def __init__(self, message: str, program: str | None, verifier_log: str, errno: int = 0):
        super().__init__(message, errno)
        self.program = program
        self.verifier_log = verifier_log

    def __str__(self) -> str:
        text = super().__str__()
        if self.verifier_log:
            tail = self.verifier_log.strip().splitlines()[-40:]
            text += "\n-- verifier log (last lines) --\n" + "\n".join(tail)
        return text


# -- the library ----------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lock = threading.RLock()
_captured: list[str] | None = None  # libbpf messages while a load holds _lock

_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
_libc.vsnprintf.restype = ctypes.c_int


def _on_print(level: int, fmt: bytes, args: int) -> int:
    # x86-64 and arm64 pass va_list by reference here, so vsnprintf can consume it.
    buf = ctypes.create_string_buffer(4096)
    _libc.vsnprintf(buf, len(buf), fmt, args)
    text = buf.value.decode("utf-8", "replace")
    if _captured is not None:
        _captured.append(text)
    if level == _LIBBPF_WARN:
        log.debug("libbpf: %s", text.rstrip())
    return 0


_print_cb = _PRINT_FN(_on_print)

_P = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[object, list]] = {
    "libbpf_set_print": (_P, [_PRINT_FN]),
    "bpf_object__open_file": (_P, [ctypes.c_char_p, _P]),
    "bpf_object__load": (ctypes.c_int, [_P]),
    "bpf_object__close": (None, [_P]),
    "bpf_object__btf": (_P, [_P]),
    "bpf_object__find_map_by_name": (_P, [_P, ctypes.c_char_p]),
    "bpf_object__find_program_by_name": (_P, [_P, ctypes.c_char_p]),
    "bpf_object__next_program": (_P, [_P, _P]),
    "bpf_object__next_map": (_P, [_P, _P]),
    "bpf_program__name": (ctypes.c_char_p, [_P]),
    "bpf_program__fd": (ctypes.c_int, [_P]),
    "bpf_program__set_log_buf": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t]),
    "bpf_map__name": (ctypes.c_char_p, [_P]),
    "bpf_map__fd": (ctypes.c_int, [_P]),
    "bpf_map__type": (ctypes.c_int, [_P]),
    "bpf_map__key_size": (ctypes.c_uint32, [_P]),
    "bpf_map__value_size": (ctypes.c_uint32, [_P]),
    "bpf_map__max_entries": (ctypes.c_uint32, [_P]),
    "bpf_map__set_max_entries": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "bpf_map__initial_value": (_P, [_P, ctypes.POINTER(ctypes.c_size_t)]),
    "bpf_map__set_pin_path": (ctypes.c_int, [_P, ctypes.c_char_p]),
    "bpf_map__unpin": (ctypes.c_int, [_P, ctypes.c_char_p]),
    "btf__find_by_name_kind": (ctypes.c_int32, [_P, ctypes.c_char_p, ctypes.c_uint32]),
    "btf__type_by_id": (_P, [_P, ctypes.c_uint32]),
    "btf__name_by_offset": (ctypes.c_char_p, [_P, ctypes.c_uint32]),
    "bpf_map_update_elem": (ctypes.c_int, [ctypes.c_int, _P, _P, ctypes.c_uint64]),
    "bpf_map_lookup_elem": (ctypes.c_int, [ctypes.c_int, _P, _P]),
    "bpf_map_delete_elem": (ctypes.c_int, [ctypes.c_int, _P]),
    "bpf_map_get_next_key": (ctypes.c_int, [ctypes.c_int, _P, _P]),
    "bpf_obj_get": (ctypes.c_int, [ctypes.c_char_p]),
    "bpf_obj_get_info_by_fd": (ctypes.c_int, [ctypes.c_int, _P, ctypes.POINTER(ctypes.c_uint32)]),
    "bpf_prog_get_fd_by_id": (ctypes.c_int, [ctypes.c_uint32]),
    "bpf_prog_attach": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint]),
    "bpf_prog_detach2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    "bpf_prog_test_run_opts": (ctypes.c_int, [ctypes.c_int, _P]),
    "libbpf_num_possible_cpus": (ctypes.c_int, []),
}


def lib() -> ctypes.CDLL:
    """libbpf.so.1, loaded once; raises :class:`BPFUnavailable` if it is not installed."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    if _lib_error is not None:
        raise BPFUnavailable(_lib_error)
    names = ["libbpf.so.1", ctypes.util.find_library("bpf")]
    for name in filter(None, names):
        try:
            candidate = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        try:
            for fn, (restype, argtypes) in _SIGNATURES.items():
                func = getattr(candidate, fn)
                func.restype = restype
                func.argtypes = argtypes
        except AttributeError as exc:
            _lib_error = f"{name} is too old for aiproxy ({exc}); need libbpf >= 1.0"
            raise BPFUnavailable(_lib_error) from None
        candidate.libbpf_set_print(_print_cb)
        _lib = candidate
        return _lib
    _lib_error = "libbpf.so.1 not found (Debian: apt-get install libbpf1)"
    raise BPFUnavailable(_lib_error)


def _err(rc: int) -> int:
    """libbpf returns -errno (or -1 with errno set)."""
    if rc < -1:
        return -rc
    return ctypes.get_errno() or _errno.EINVAL


def _unavailable_errno(code: int) -> bool:
    return code in (_errno.EPERM, _errno.EACCES, _errno.ENOSYS, _errno.EOPNOTSUPP)


def num_possible_cpus() -> int:
    n = lib().libbpf_num_possible_cpus()
    if n <= 0:
        raise BPFError("cannot count possible CPUs", -n)
    return n


def object_path(name: str) -> Path:
    """The built object for program family ``name`` (e.g. "xdp_guard")."""
    base = Path(os.environ.get("AIPROXY_BPF_OBJECTS", OBJECTS_DIR))
    path = base / f"{name}.bpf.o"
    if not path.is_file():
        raise BPFUnavailable(
            f"{path} is missing: the BPF objects were not built "
            "(needs clang and libbpf-dev; run `make -C bpf`)"
        )
    return path


# -- objects ----------------------------------------------------------------------------


class _BtfType(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32),
                ("size", ctypes.c_uint32)]


class _VarSecinfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("offset", ctypes.c_uint32),
                ("size", ctypes.c_uint32)]


class BpfObject:
    """One loaded ELF object: its programs and maps.

    ``rodata`` sets ``const volatile`` globals before load (int or bytes by name);
    ``max_entries`` resizes maps; ``pin_dir`` pins every map there (by map name) and
    reuses maps already pinned there, so their contents survive a re-attach.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rodata: Mapping[str, int | bytes] | None = None,
        max_entries: Mapping[str, int] | None = None,
        pin_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.name = Path(self.path).name.split(".")[0]
        self._obj: int | None = None
        self._log_bufs: dict[str, ctypes.Array] = {}
        self.maps: dict[str, Map] = {}
        self.programs: dict[str, Program] = {}
        self._load(rodata or {}, max_entries or {}, pin_dir)

    def _load(self, rodata, max_entries, pin_dir) -> None:
        global _captured
        libbpf = lib()
        with _lock:
            _captured = []
            try:
                ctypes.set_errno(0)
                obj = libbpf.bpf_object__open_file(self.path.encode(), None)
                if not obj:
                    code = ctypes.get_errno() or _errno.EINVAL
                    raise BPFError(
                        f"{self.path}: cannot open BPF object: {os.strerror(code)}"
                        + _tail(_captured), code)
                self._obj = obj
                for name, value in rodata.items():
                    self._set_rodata(name, value)
                for name, entries in max_entries.items():
                    rc = libbpf.bpf_map__set_max_entries(self._find_map(name), entries)
                    if rc:
                        raise BPFError(f"{self.name}: map {name}: cannot resize", _err(rc))
                prog = libbpf.bpf_object__next_program(obj, None)
                while prog:
                    pname = libbpf.bpf_program__name(prog).decode()
                    buf = ctypes.create_string_buffer(LOG_BUF_SIZE)
                    libbpf.bpf_program__set_log_buf(prog, buf, LOG_BUF_SIZE)
                    self._log_bufs[pname] = buf
                    prog = libbpf.bpf_object__next_program(obj, prog)
                if pin_dir is not None:
                    self._set_pins(os.fspath(pin_dir))
                rc = libbpf.bpf_object__load(obj)
                if rc:
                    self._load_failed(_err(rc), list(_captured))
            except BaseException:
                self.close()
                raise
            finally:
                _captured = None
        self._collect()
        self._log_bufs.clear()  # only needed on failure

    def _load_failed(self, code: int, messages: list[str]) -> None:
        failed = None
        verifier_log = ""
        for pname, buf in self._log_bufs.items():
            text = buf.value.decode("utf-8", "replace")
            if text:
                failed, verifier_log = pname, text
                break
        if failed is None:
            for line in messages:
                if line.startswith("libbpf: prog '"):
                    failed = line.split("'")[1]
                    break
        if _unavailable_errno(code) and not verifier_log:
            raise BPFUnavailable(
                f"{self.name}: the kernel refused bpf(): {os.strerror(code)} "
                "(needs root or CAP_BPF+CAP_NET_ADMIN)" + _tail(messages), code)
        where = f"program {failed!r} in {self.path}" if failed else self.path
        raise BPFLoadError(
            f"{self.name}: cannot load {where}: {os.strerror(code)}" + _tail(messages),
            failed, verifier_log, code)

    def _find_map(self, name: str) -> int:
        ptr = lib().bpf_object__find_map_by_name(self._obj, name.encode())
        if not ptr:
            raise BPFError(f"{self.name}: no map named {name!r}")
        return ptr

    def _set_rodata(self, name: str, value: int | bytes) -> None:
        libbpf = lib()
        btf = libbpf.bpf_object__btf(self._obj)
        if not btf:
            raise BPFError(f"{self.name}: object has no BTF (built without -g?)")
        sec_id = libbpf.btf__find_by_name_kind(btf, b".rodata", _BTF_KIND_DATASEC)
        if sec_id < 0:
            raise BPFError(f"{self.name}: no const volatile globals (.rodata) to set {name}")
        sec = _BtfType.from_address(libbpf.btf__type_by_id(btf, sec_id))
        base = libbpf.btf__type_by_id(btf, sec_id) + ctypes.sizeof(_BtfType)
        for i in range(sec.info & 0xFFFF):
            var = _VarSecinfo.from_address(base + i * ctypes.sizeof(_VarSecinfo))
            vtype = _BtfType.from_address(libbpf.btf__type_by_id(btf, var.type))
            if libbpf.btf__name_by_offset(btf, vtype.name_off).decode() != name:
                continue
            if isinstance(value, int):
                data = value.to_bytes(var.size, "little", signed=value < 0)
            else:
                data = bytes(value)
                if len(data) != var.size:
                    raise BPFError(f"{self.name}: {name} is {var.size} bytes, got {len(data)}")
            size = ctypes.c_size_t()
            ptr = libbpf.bpf_map__initial_value(self._find_map(".rodata"), ctypes.byref(size))
            if not ptr or var.offset + var.size > size.value:
                raise BPFError(f"{self.name}: cannot set {name}")
            ctypes.memmove(ptr + var.offset, data, var.size)
            return
        raise BPFError(f"{self.name}: no const volatile global named {name!r}")

    def _set_pins(self, pin_dir: str) -> None:
        libbpf = lib()
        try:
            os.makedirs(pin_dir, exist_ok=True)
        except OSError as exc:
            raise BPFPinError(f"{self.name}: cannot pin its maps in {pin_dir}: cannot create "
                              f"{exc.filename or pin_dir}: {exc.strerror}", exc.errno) from None
        m = libbpf.bpf_object__next_map(self._obj, None)
        while m:
            mname = libbpf.bpf_map__name(m).decode()
            if "." not in mname:  # not .rodata/.bss internals
                rc = libbpf.bpf_map__set_pin_path(m, os.path.join(pin_dir, mname).encode())
                if rc:
                    raise BPFError(f"{self.name}: cannot pin {mname} in {pin_dir}", _err(rc))
            m = libbpf.bpf_object__next_map(self._obj, m)

    def _collect(self) -> None:
        libbpf = lib()
        m = libbpf.bpf_object__next_map(self._obj, None)
        while m:
            mname = libbpf.bpf_map__name(m).decode()
            self.maps[mname] = Map(
                mname, libbpf.bpf_map__fd(m), libbpf.bpf_map__type(m),
                libbpf.bpf_map__key_size(m), libbpf.bpf_map__value_size(m),
                libbpf.bpf_map__max_entries(m), owner=self)
            m = libbpf.bpf_object__next_map(self._obj, m)
        p = libbpf.bpf_object__next_program(self._obj, None)
        while p:
            pname = libbpf.bpf_program__name(p).decode()
            self.programs[pname] = Program(pname, libbpf.bpf_program__fd(p), owner=self)
            p = libbpf.bpf_object__next_program(self._obj, p)

    def program(self, name: str) -> Program:
        try:
            return self.programs[name]
        except KeyError:
            raise BPFError(f"{self.name}: no program named {name!r}") from None

    def map(self, name: str) -> Map:
        try:
            return self.maps[name]
        except KeyError:
            raise BPFError(f"{self.name}: no map named {name!r}") from None

    def unpin(self) -> None:
        libbpf = lib()
        m = libbpf.bpf_object__next_map(self._obj, None)
        while m:
            libbpf.bpf_map__unpin(m, None)
            m = libbpf.bpf_object__next_map(self._obj, m)

    def close(self) -> None:
        """Close the object's fds; attached programs stay attached until detached."""
        if self._obj:
            lib().bpf_object__close(self._obj)
            self._obj = None
            for m in self.maps.values():
                m.fd = -1
            for p in self.programs.values():
                p.fd = -1

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _tail(messages: list[str], n: int = 8) -> str:
    lines = [line.rstrip() for line in messages if line.strip()]
    lines = [line for line in lines if "BEGIN PROG LOAD LOG" not in line][-n:]
    return ("\n" + "\n".join(lines)) if lines else ""


# -- maps -------------------------------------------------------------------------------


def _buf(data: bytes | ctypes.Structure | ctypes.Array | int, size: int, what: str):
    if isinstance(data, int):
        data = data.to_bytes(size, "little")
    raw = bytes(data)
    if len(raw) != size:
        raise BPFError(f"{what}: expected {size} bytes, got {len(raw)}")
    return ctypes.create_string_buffer(raw, size)


class Map:
    """A BPF map by fd. Keys and values are bytes (or ctypes structures / ints)."""

    def __init__(self, name: str, fd: int, map_type: int, key_size: int, value_size: int,
                 max_entries: int, owner: object = None) -> None:
        self.name = name
        self.fd = fd
        self.type = map_type
        self.key_size = key_size
        self.value_size = value_size
        self.max_entries = max_entries
        self._owner = owner  # keeps the object (and so the fd) alive
        self.percpu = map_type in _PERCPU_TYPES
        self.ncpus = num_possible_cpus() if self.percpu else 1
        stride = (value_size + 7) // 8 * 8
        self._stride = stride if self.percpu else value_size
        self._value_buf_size = stride * self.ncpus if self.percpu else value_size

    @classmethod
    def from_pin(cls, path: str | os.PathLike[str]) -> Map:
        libbpf = lib()
        fd = libbpf.bpf_obj_get(os.fspath(path).encode())
        if fd < 0:
            code = _err(fd)
            raise BPFError(f"cannot open pinned map {path}: {os.strerror(code)}", code)
        info = (ctypes.c_uint8 * 256)()
        size = ctypes.c_uint32(ctypes.sizeof(info))
        rc = libbpf.bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size))
        if rc:
            os.close(fd)
            raise BPFError(f"cannot query pinned map {path}", _err(rc))
        words = (ctypes.c_uint32 * 6).from_buffer(info)
        name = bytes(info[24:40]).split(b"\0")[0].decode()
        m = cls(name, fd, words[0], words[2], words[3], words[4])
        m._owned_fd = fd
        return m

    def close(self) -> None:
        fd = getattr(self, "_owned_fd", None)
        if fd is not None and fd >= 0:
            os.close(fd)
            self._owned_fd = -1
            self.fd = -1

    def _check(self, rc: int, op: str) -> None:
        if rc:
            code = _err(rc)
            raise BPFError(f"map {self.name}: {op}: {os.strerror(code)}", code)

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        k = _buf(key, self.key_size, f"map {self.name} key")
        if self.percpu and not isinstance(value, list | tuple):
            value = [value] * self.ncpus
        if self.percpu:
            raw = b"".join(bytes(_buf(v, self.value_size, f"map {self.name} value"))[
                :self.value_size].ljust(self._stride, b"\0") for v in value)
            v = ctypes.create_string_buffer(raw, self._value_buf_size)
        else:
            v = _buf(value, self.value_size, f"map {self.name} value")
        self._check(lib().bpf_map_update_elem(self.fd, k, v, flags), "update")

    def lookup(self, key) -> bytes | None:
        """The value (per-CPU maps: see :meth:`lookup_percpu`), or None when absent."""
        if self.percpu:
            values = self.lookup_percpu(key)
            return None if values is None else values[0]
        k = _buf(key, self.key_size, f"map {self.name} key")
        v = ctypes.create_string_buffer(self._value_buf_size)
        rc = lib().bpf_map_lookup_elem(self.fd, k, v)
        if rc:
            if _err(rc) == _errno.ENOENT:
                return None
            self._check(rc, "lookup")
        return v.raw

    def lookup_percpu(self, key) -> list[bytes] | None:
        k = _buf(key, self.key_size, f"map {self.name} key")
        v = ctypes.create_string_buffer(self._value_buf_size)
        rc = lib().bpf_map_lookup_elem(self.fd, k, v)
        if rc:
            if _err(rc) == _errno.ENOENT:
                return None
            self._check(rc, "lookup")
        raw = v.raw
        return [raw[i * self._stride:i * self._stride + self.value_size]
                for i in range(self.ncpus)]

    def delete(self, key) -> bool:
        k = _buf(key, self.key_size, f"map {self.name} key")
        rc = lib().bpf_map_delete_elem(self.fd, k)
        if rc:
            if _err(rc) == _errno.ENOENT:
                return False
            self._check(rc, "delete")
        return True

    def keys(self) -> Iterator[bytes]:
        libbpf = lib()
        prev = None
        nxt = ctypes.create_string_buffer(self.key_size)
        while True:
            rc = libbpf.bpf_map_get_next_key(self.fd, prev, nxt)
            if rc:
                if _err(rc) == _errno.ENOENT:
                    return
                self._check(rc, "get_next_key")
            key = nxt.raw
            yield key
            prev = ctypes.create_string_buffer(key, self.key_size)

    def clear(self) -> None:
        for key in list(self.keys()):
            self.delete(key)


# -- programs ---------------------------------------------------------------------------


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


@dataclass(frozen=True, slots=True)
class TestRun:
    retval: int
    duration_ns: int  # average per repetition
    data: bytes
    ctx: bytes | None

    __test__ = False  # not a pytest class


class Program:
    def __init__(self, name: str, fd: int, owner: object = None) -> None:
        self.name = name
        self.fd = fd
        self._owner = owner

    def info(self) -> ProgInfo:
        return prog_info(self.fd)

    def test_run(self, data: bytes, *, repeat: int = 1, ctx: bytes | None = None,
                 ctx_out_size: int = 0) -> TestRun:
        """BPF_PROG_TEST_RUN: run the program on ``data`` (``repeat`` times)."""
        data_in = ctypes.create_string_buffer(bytes(data), len(data))
        data_out = ctypes.create_string_buffer(len(data) + 256)
        opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts))
        opts.data_in = ctypes.cast(data_in, ctypes.c_void_p)
        opts.data_size_in = len(data)
        opts.data_out = ctypes.cast(data_out, ctypes.c_void_p)
        opts.data_size_out = len(data_out)
        opts.repeat = repeat
        ctx_in = ctx_out = None
        if ctx is not None:
            ctx_in = ctypes.create_string_buffer(bytes(ctx), len(ctx))
            opts.ctx_in = ctypes.cast(ctx_in, ctypes.c_void_p)
            opts.ctx_size_in = len(ctx)
        if ctx_out_size:
            ctx_out = ctypes.create_string_buffer(ctx_out_size)
            opts.ctx_out = ctypes.cast(ctx_out, ctypes.c_void_p)
            opts.ctx_size_out = ctx_out_size
        rc = lib().bpf_prog_test_run_opts(self.fd, ctypes.byref(opts))
        if rc:
            code = _err(rc)
            raise BPFError(f"program {self.name}: test run: {os.strerror(code)}", code)
        return TestRun(opts.retval, opts.duration, data_out.raw[:opts.data_size_out],
                       ctx_out.raw[:opts.ctx_size_out] if ctx_out is not None else None)


PROG_TYPE_XDP = 6


@dataclass(frozen=True, slots=True)
class ProgInfo:
    """What the kernel says about a loaded program (struct bpf_prog_info)."""

    id: int
    type: int
    name: str  # at most 15 bytes: the kernel keeps BPF_OBJ_NAME_LEN - 1
    tag: str


def prog_info(fd: int) -> ProgInfo:
    """The kernel's info on the program behind ``fd``."""
    info = (ctypes.c_uint8 * 256)()  # bpf_prog_info is ~230 bytes; the kernel fills what fits
    size = ctypes.c_uint32(ctypes.sizeof(info))
    rc = lib().bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size))
    if rc:
        code = _err(rc)
        raise BPFError(f"cannot query BPF program (fd {fd}): {os.strerror(code)}", code)
    words = (ctypes.c_uint32 * 2).from_buffer(info)
    return ProgInfo(id=words[1], type=words[0], tag=bytes(info[8:16]).hex(),
                    name=bytes(info[64:80]).split(b"\0")[0].decode(errors="replace"))


def prog_fd_by_id(prog_id: int) -> int:
    """A new fd for the loaded program ``prog_id`` (the caller closes it); BPFError
    with errno ENOENT when there is no such program (any more)."""
    fd = lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        code = _err(fd)
        raise BPFError(f"cannot open BPF program id {prog_id}: {os.strerror(code)}", code)
    return fd


def prog_attach(prog: Program, target_fd: int, attach_type: int, flags: int = 0) -> None:
    rc = lib().bpf_prog_attach(prog.fd, target_fd, attach_type, flags)
    if rc:
        code = _err(rc)
        raise BPFError(f"program {prog.name}: attach: {os.strerror(code)}", code)


def prog_detach(prog: Program, target_fd: int, attach_type: int) -> None:
    rc = lib().bpf_prog_detach2(prog.fd, target_fd, attach_type)
    if rc:
        code = _err(rc)
        raise BPFError(f"program {prog.name}: detach: {os.strerror(code)}", code)


def probe() -> str | None:
    """None when BPF objects can be loaded here, else the reason they cannot."""
    try:
        with BpfObject(object_path("sk_splice")):
            pass
    except BPFError as exc:
        return str(exc)
    return None
