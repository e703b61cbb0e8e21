"""Checks of the files a config names, so that what `aiproxy check` accepts also starts."""

from __future__ import annotations

import hashlib
import os
import ssl


def file_sha256(path: str) -> str:
    """The hex SHA-256 of a file's bytes ("" if it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return ""


def writable_file_problem(path: str) -> str | None:
    """Why a log the proxy appends to cannot be opened at `path` (None: it can)."""
    if os.path.isdir(path):
        return f"'{path}' is a directory"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"no such directory '{parent}'"
    return None


def tls_problems(cert: str | None, key: str | None,
                 ca: str | None) -> list[tuple[str, str]]:
    """(key, message) for each of a TLS certificate, its private key and a CA bundle
    (whichever are given) that OpenSSL will not load: a listener with them would fail
    only when it starts, with a message that names none of them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    problems = []
    cert_ok = key_ok = False
    if cert is not None:
        try:
            with open(cert, "rb") as fh:
                x509.load_pem_x509_certificates(fh.read())
            cert_ok = True
        except (OSError, ValueError) as exc:
            problems.append(("cert", f"not a PEM certificate: {_reason(exc)}"))
    if key is not None:
        try:
            with open(key, "rb") as fh:
                serialization.load_pem_private_key(fh.read(), password=None)
            key_ok = True
        except (OSError, ValueError, TypeError) as exc:
            problems.append(("key", f"not an unencrypted PEM private key: {_reason(exc)}"))
    if cert_ok and key_ok:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            problems.append(("key", f"does not fit the certificate ({exc.reason or exc})"))
    if ca is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            problems.append(("ca", f"no PEM certificate could be loaded: {_reason(exc)}"))
    return problems


def cert_dns_names(cert: str) -> tuple[str, ...]:
    """The DNS names of the first certificate in a PEM file (subjectAltName; RFC 6125:
    the subject's CN is not looked at), lowercased; () if it has none or does not load."""
    from cryptography import x509

    try:
        with open(cert, "rb") as fh:
            leaf = x509.load_pem_x509_certificates(fh.read())[0]
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (OSError, ValueError, IndexError, x509.ExtensionNotFound):
        return ()
    return tuple(dict.fromkeys(n.lower() for n in san.value.get_values_for_type(x509.DNSName)))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc).split("\n")[0]
