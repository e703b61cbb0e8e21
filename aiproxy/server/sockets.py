"""Listening sockets bound here, not by loop.create_server(host, port), and why a
worker keeps free of threads.

A process that has never started a thread runs faster in glibc: its syscall wrappers
skip the thread-cancellation bookkeeping and malloc skips its arena locks. For a worker
proxying small responses that is about 4% of its CPU per request (bench/e2e.py, A/B).
Once a thread has started, glibc keeps the slower paths for the life of the process and
in every fork of it. So a worker that has nothing to block on starts no thread:
- uvloop resolves the host given to create_server on libuv's thread pool, even a
  numeric one, which starts four threads; the addresses are resolved here instead
  (socket.getaddrinfo blocks, which at startup is what it should do);
- work that may block runs on a thread only when the config asks for it (the kernel
  fast paths, loading an intent model; see app.py);
- numpy's OpenBLAS starts its thread pool when it is imported: the command line sets
  OPENBLAS_NUM_THREADS=1 unless it is set (cli.py).
Features that need a thread still start one: the access log and audit writers, the
intent classifier, DNS names of upstream endpoints.
"""

from __future__ import annotations

import socket


def bound_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """One bound TCP socket per address `host` resolves to, set up as asyncio's
    create_server sets them up (SO_REUSEADDR; IPV6_V6ONLY on IPv6, so "::" is IPv6
    only). Raises OSError (socket.gaierror for a name), leaving no socket open."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks
