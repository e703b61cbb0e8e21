"""Kernel fast paths: BPF programs (bpf/*.c) loaded with libbpf (ctypes), attached with
pyroute2, fed from the config's [kernel] section.

Everything here is optional: when the objects were not built (no clang), libbpf is
missing, or the kernel refuses bpf(), the loaders raise :class:`BPFUnavailable` and the
proxy carries on in user space.
"""

from .libbpf import BPFError, BPFLoadError, BPFUnavailable

__all__ = ["BPFError", "BPFLoadError", "BPFUnavailable"]
