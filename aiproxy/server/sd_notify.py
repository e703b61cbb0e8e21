"""systemd's notify protocol: datagrams on $NOTIFY_SOCKET (no libsystemd needed)."""

from __future__ import annotations

import os
import socket
import time


def notify(message: str) -> bool:
    """Send one state string (e.g. "READY=1"); False when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]  # abstract socket namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError:
        return False
    return True


def reloading() -> bool:
    # Type=notify-reload wants MONOTONIC_USEC with RELOADING=1.
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def watchdog_interval() -> float | None:
    """Half the WatchdogSec systemd set for this process, in seconds, or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000
