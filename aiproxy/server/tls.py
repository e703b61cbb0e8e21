"""TLS listeners' contexts, and their certificates re-read on reload.

A listener's ssl.SSLContext is made once, when it starts, and handed to the loop's
server. On reload (SIGHUP, `POST /config/reload`, or the text a supervisor sends its
workers) the certificate, key and client CA files are stat()ed; when one changed (a
certbot renewal, a new file renamed over the path or a symlink pointed elsewhere) they
are checked on a scratch context first and only then loaded into the live context
again. OpenSSL copies the context's certificate into each SSL object when a handshake
starts, so new handshakes present the new certificate while connections already up keep
theirs. A certificate or key that does not load rejects the whole reload, naming the
file and the key; the live context is not touched and the old certificate keeps serving.

The address, the protocols and whether a listener has TLS or client CAs at all still
take effect on restart only: the socket, ALPN list and verify mode belong to the bound
listener. A CA bundle is added to the context's trust store (OpenSSL has no way to empty
it from Python): a CA removed from the bundle stays trusted until a restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
from typing import Any

from aiproxy.config import ConfigError, ListenerConfig
from aiproxy.config.errors import Problem
from aiproxy.config.files import tls_problems
from aiproxy.config.schema import TlsConfig

log = logging.getLogger("aiproxy.server")

Stamp = tuple[tuple[str, tuple | None], ...]


class AlertingSSLObject(ssl.SSLObject):
    """A listener connection's TLS state that sends the fatal alert of a failed
    handshake (RFC 8446 6.2: protocol_version, handshake_failure, certificate_required,
    unknown_ca, certificate_expired...). uvloop's TLS layer, like asyncio's before
    CPython gh-98078, closes the socket without writing out what OpenSSL left in the
    outgoing buffer, so the client saw only an EOF and could not tell why.

    `send` is the connection's transport.write, set by the protocol that starts TLS
    (app.TlsOrPlain) right after the TLS layer made this object: `made` hands it over
    (one loop thread; the TLS layer makes it synchronously in connection_made)."""

    made: AlertingSSLObject | None = None
    send: Any = None
    outgoing: ssl.MemoryBIO

    @classmethod
    def _create(cls, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                **kwargs: Any) -> AlertingSSLObject:
        obj = super()._create(incoming, outgoing, **kwargs)  # type: ignore[misc]
        obj.outgoing = outgoing
        AlertingSSLObject.made = obj
        return obj

    @classmethod
    def take(cls) -> AlertingSSLObject | None:
        obj, cls.made = cls.made, None
        return obj

    def do_handshake(self) -> None:
        try:
            self._sslobj.do_handshake()  # type: ignore[attr-defined]
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError:
            alert = self.outgoing.read()
            if alert and self.send is not None:
                self.send(alert)  # the TLS layer closes the transport next
            raise


# Python 3.11.0-3.11.2 (Debian 12's) set this by default with OpenSSL 3 (gh-95494): a TCP
# close then reads as close_notify, so a truncated body would pass for a whole one.
IGNORE_UNEXPECTED_EOF = getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)


def server_context(listener: ListenerConfig, cert: str, key: str) -> ssl.SSLContext:
    """TLS 1.2+ with ALPN from the listener's protocols (RFC 9113 9.2 cipher rules)."""
    tls = listener.tls
    assert tls is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.options &= ~IGNORE_UNEXPECTED_EOF
    ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
    ctx.load_cert_chain(cert, key)
    if tls.ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(tls.ca)
    alpn = []
    if "h2" in listener.protocols:
        alpn.append("h2")
    if "http1" in listener.protocols:
        alpn.append("http/1.1")
    ctx.set_alpn_protocols(alpn)
    ctx.sslobject_class = AlertingSSLObject
    return ctx


class SniSelector:
    """The listener context's sni_callback: hands a handshake whose client names a host
    (RFC 6066 server_name) to the context of the `certificates` entry that lists it,
    exactly or by a `*.` wildcard of one label. The listener's own certificate serves
    every other handshake, those without SNI among them. OpenSSL calls this before it
    picks the certificate and the ALPN protocol, and both come from the context set here;
    each entry's context carries the listener's client CAs and ALPN list too.
    `default`, once a reload made one, serves the other handshakes in place of the
    listener's first context (see ListenerTls.reload)."""

    __slots__ = ("by_name", "default")

    def __init__(self, by_name: dict[str, ssl.SSLContext],
                 default: ssl.SSLContext | None = None) -> None:
        self.by_name = by_name
        self.default = default

    def __call__(self, conn: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        chosen = None
        if server_name is not None:
            by_name = self.by_name
            name = server_name.lower()  # an A-label: Python hands IDNs over as "xn--..."
            chosen = by_name.get(name)
            if chosen is None:
                dot = name.find(".")
                if dot > 0:
                    chosen = by_name.get("*" + name[dot:])
        if chosen is None:
            chosen = self.default
        if chosen is not None:
            conn.context = chosen


def sni_contexts(listener: ListenerConfig) -> dict[str, ssl.SSLContext]:
    tls = listener.tls
    assert tls is not None
    by_name = {}
    for entry in tls.certificates:
        ctx = server_context(listener, entry.cert, entry.key)
        for name in entry.server_names:
            by_name[name] = ctx
    return by_name


def tls_context(listener: ListenerConfig) -> ssl.SSLContext:
    """The listener's context: its own certificate, and the `certificates` entries' by SNI."""
    tls = listener.tls
    assert tls is not None
    ctx = server_context(listener, tls.cert, tls.key)
    if tls.certificates:
        ctx.sni_callback = SniSelector(sni_contexts(listener))
    return ctx


def restart_shape(listeners: tuple[ListenerConfig, ...] | list[ListenerConfig]) -> list:
    """What of the listeners only a restart changes: everything but the TLS file paths
    (whether there is TLS, and client CAs, is kept)."""
    return [(dataclasses.replace(lst, tls=None), lst.tls is not None,
             lst.tls is not None and lst.tls.ca is not None) for lst in listeners]


def file_stamp(tls: TlsConfig) -> Stamp:
    """Path and identity (device, inode, size, mtime, ctime) of each file, None for one
    that cannot be stat()ed; and the server names of the `certificates` entries."""
    out: list[tuple[str, tuple | None]] = []
    for path in tls.files():
        try:
            st = os.stat(path)
        except OSError:
            out.append((path, None))
            continue
        out.append((path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)))
    out.append(("server_names", tuple(e.server_names for e in tls.certificates)))
    return tuple(out)


class ListenerTls:
    """One TLS listener's live context and the files it was last loaded from."""

    def __init__(self, listener: ListenerConfig) -> None:
        assert listener.tls is not None
        self.listener = listener
        self.stamp = file_stamp(listener.tls)  # taken before reading: a change after shows
        self.ctx = tls_context(listener)

    def wanted(self, new: ListenerConfig) -> Stamp | None:
        """The new stamp if `new` (the same listener in a new config) asks for its files
        to be loaded again, else None (unchanged, or a change that needs a restart)."""
        if new.tls is None or restart_shape([new]) != restart_shape([self.listener]):
            return None
        stamp = file_stamp(new.tls)
        return None if stamp == self.stamp else stamp

    def check(self, new: ListenerConfig, source: str) -> None:
        """ConfigError naming each file of `new` that would not load; the live context
        is not touched."""
        tls = new.tls
        assert tls is not None
        sets = [("", {"cert": tls.cert, "key": tls.key, "ca": tls.ca})]
        sets += [(f"certificates.{i}.", {"cert": e.cert, "key": e.key})
                 for i, e in enumerate(tls.certificates)]
        problems = [(prefix, files, key, message) for prefix, files in sets
                    for key, message in tls_problems(files["cert"], files["key"],
                                                     files.get("ca"))]
        if not problems:
            try:  # what reload() will do, on contexts of its own
                tls_context(new)
            except (OSError, ssl.SSLError) as exc:
                problems = [("", sets[0][1], "cert", f"does not load: {exc}")]
        if problems:
            raise ConfigError([
                Problem(source, 0, f"listeners.{new.name}.tls.{prefix}{key}",
                        f"'{files[key]}': {message} (the running certificate keeps serving)")
                for prefix, files, key, message in problems])

    def reload(self, new: ListenerConfig, stamp: Stamp) -> None:
        """New contexts from the new files (check() passed just before), which the next
        handshakes switch to as they start (the listening socket keeps its first
        context): loading into the live one would only add to its trusted client CAs,
        so a CA dropped from the bundle would stay trusted."""
        tls = new.tls
        assert tls is not None
        fresh = server_context(new, tls.cert, tls.key)
        self.ctx.sni_callback = SniSelector(sni_contexts(new), fresh)
        self.listener = new
        self.stamp = stamp
        log.info("listener %s: TLS certificate reloaded from %s", new.name, tls.cert)
