"""Notice that a file changed (JWKS, API key files, policy files) without a syscall per
request: stat at most once per `interval` seconds, compared by (inode, size, mtime_ns)
so an editor's rename-over counts as a change too."""

from __future__ import annotations

import os
from time import monotonic


def file_stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class FileWatch:
    __slots__ = ("paths", "interval", "stamps", "checked")

    def __init__(self, paths: tuple[str, ...] | list[str], interval: float = 0.25) -> None:
        self.paths = tuple(paths)
        self.interval = interval
        self.stamps = [file_stamp(p) for p in self.paths]
        self.checked = monotonic()

    def changed(self, force: bool = False) -> bool:
        """True once per change of any of the files (checks at most every interval)."""
        now = monotonic()
        if not force and now - self.checked < self.interval:
            return False
        self.checked = now
        stamps = [file_stamp(p) for p in self.paths]
        if stamps == self.stamps:
            return False
        self.stamps = stamps
        return True
