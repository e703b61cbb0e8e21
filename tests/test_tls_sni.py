"""A TLS listener with several certificates, picked by the client's server name (SNI,
RFC 6066 3): `tls.certificates = [{ cert, key, server_names }]`. Real clients (Python's
ssl, curl) check the chain and the host name against the served certificate; the
listener's own certificate serves a handshake without SNI or with a name no entry lists.
A renewed entry's certificate is served after SIGHUP; a bad entry is an error naming the
file, line and key."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CRASH_MARKERS
from tests.h2_support import Pki, make_pki
from tests.support import free_port, start_process, stop_process, wait_port
from tests.test_tls_reload import der, install, wait_log

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue(pki: Pki, name: str, san: str | None) -> tuple[Path, Path]:
    """A server certificate from the test CA for `san` (an openssl subjectAltName value),
    or with no subjectAltName at all."""
    d = pki.ca.parent
    ext = d / f"{name}.ext"
    ext.write_text((f"subjectAltName={san}\n" if san else "") + "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name,
             cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def handshake(port: int, pki: Pki, server_name: str | None,
              alpn: tuple[str, ...] = ("http/1.1",)) -> tuple[bytes, str | None, int]:
    """Connect with `server_name` as SNI (None: no SNI), verifying the chain and, with a
    name, that the certificate names it; (served certificate, ALPN protocol, status of
    GET /healthz over HTTP/1.1)."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.set_alpn_protocols(list(alpn))
    if server_name is None:
        ctx.check_hostname = False
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname=server_name)
    try:
        cert = tls.getpeercert(binary_form=True)
        proto = tls.selected_alpn_protocol()
        status = 0
        if proto in (None, "http/1.1"):
            tls.sendall(f"GET /healthz HTTP/1.1\r\nHost: {server_name or 'localhost'}\r\n"
                        "Connection: close\r\n\r\n".encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
            status = int(data.split(b" ", 2)[1])
    finally:
        tls.close()
    return cert, proto, status


@pytest.fixture
def sni_pki(tmp_path: Path) -> tuple[Pki, dict[str, tuple[Path, Path]]]:
    pki = make_pki(tmp_path / "pki")
    certs = {
        "api": issue(pki, "api", "DNS:api.test,DNS:API2.test"),
        "wild": issue(pki, "wild", "DNS:*.wild.test"),
        "bare": issue(pki, "bare", None),
    }
    return pki, certs


def write_config(tmp_path: Path, port: int, upstream: int, tls: str) -> Path:
    config = tmp_path / "aiproxy.toml"
    config.write_text(f"""
[server]
workers = 1  # "config reloaded (" is then the whole reload (tests/test_tls_reload.py does 2)
drain_timeout_ms = 2000

[[listeners]]
name = "tls"
address = "127.0.0.1:{port}"
protocols = ["h2", "http1"]
{tls}

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{upstream}"]

[[routes]]
name = "all"
cluster = "up"
""")
    return config


def test_certificate_is_picked_by_server_name(tmp_path: Path, demo_upstream, sni_pki):
    pki, certs = sni_pki
    live = tmp_path / "live"
    live.mkdir()
    api_cert, api_key = live / "api.pem", live / "api.key"
    shutil.copyfile(certs["api"][0], api_cert)
    shutil.copyfile(certs["api"][1], api_key)
    port = free_port()
    # The api entry takes its names from its certificate; the wildcard one names its own.
    config = write_config(tmp_path, port, demo_upstream, f"""
[listeners.tls]
cert = "{pki.cert}"
key = "{pki.key}"

[[listeners.tls.certificates]]
cert = "{api_cert}"
key = "{api_key}"

[[listeners.tls.certificates]]
server_names = ["*.wild.test"]
cert = "{certs['wild'][0]}"
key = "{certs['wild'][1]}"
""")
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(config)])
    try:
        wait_port("127.0.0.1", port, timeout=60, proc=proc)
        default, api, wild = der(pki.cert), der(certs["api"][0]), der(certs["wild"][0])
        assert handshake(port, pki, "api.test")[::2] == (api, 200)
        assert handshake(port, pki, "API2.Test")[0] == api  # names are case-insensitive
        assert handshake(port, pki, "x.wild.test")[::2] == (wild, 200)
        # No SNI, a name no entry lists, two labels under the wildcard: the listener's own.
        assert handshake(port, pki, None)[::2] == (default, 200)
        assert handshake(port, pki, "localhost")[::2] == (default, 200)
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(port, pki, "a.b.wild.test")  # the default names only localhost

        # ALPN comes from the entry's context too: HTTP/2 where the client offers it.
        assert handshake(port, pki, "api.test", ("h2", "http/1.1"))[1] == "h2"

        # curl checks the chain and the name on its own, over HTTP/2 and HTTP/1.1.
        for flag, version in (("--http2", "2"), ("--http1.1", "1.1")):
            out = subprocess.run(
                ["curl", "-sS", flag, "--cacert", str(pki.ca), "--resolve",
                 f"x.wild.test:{port}:127.0.0.1", "-o", "/dev/null", "-w",
                 "%{http_code} %{http_version}", f"https://x.wild.test:{port}/healthz"],
                capture_output=True, text=True, timeout=30)
            assert out.stdout == f"200 {version}", out.stderr

        # A renewed certificate for an entry is served after SIGHUP; an entry's key that
        # does not fit its certificate rejects the reload, naming the entry's key.
        renewed = issue(pki, "api-renewed", "DNS:api.test,DNS:api2.test")
        install(renewed[0], api_cert)
        install(renewed[1], api_key)
        proc.send_signal(signal.SIGHUP)
        wait_log(proc, "config reloaded (", 1)
        assert handshake(port, pki, "api.test")[::2] == (der(renewed[0]), 200)
        assert handshake(port, pki, "x.wild.test")[0] == wild
        assert handshake(port, pki, None)[0] == default

        install(pki.key, api_key)
        proc.send_signal(signal.SIGHUP)
        log = wait_log(proc, "reload rejected", 1)
        assert "tls.certificates[0].key: does not fit the certificate" in log, log
        assert handshake(port, pki, "api.test")[0] == der(renewed[0])
    finally:
        log = stop_process(proc, timeout=15)
    assert not [m for m in CRASH_MARKERS if m in log], log


@pytest.mark.parametrize("entries, key, message", [
    ('{{ cert = "{bare}", key = "{bare_key}" }}', "certificates[0].cert",
     "names no DNS host (subjectAltName): add server_names"),
    ('{{ server_names = ["api.test"], cert = "{api}", key = "{api_key}" }}, '
     '{{ server_names = ["API.test"], cert = "{wild}", key = "{wild_key}" }}',
     "certificates[1].server_names", "'api.test' is also served by certificates[0]"),
    ('{{ server_names = ["bad_name.test"], cert = "{api}", key = "{api_key}" }}',
     "certificates[0].server_names[0]", "is not a host name"),
    ('{{ server_names = [], cert = "{api}", key = "{api_key}" }}',
     "certificates[0].server_names", "must name at least one host"),
    ('{{ cert = "{api}", key = "{wild_key}" }}', "certificates[0].key",
     "does not fit the certificate"),
    ('{{ cert = "{api}" }}', "certificates[0].key", "missing required key"),
    ('{{ cert = "{api}", key = "{api_key}", names = ["a.test"] }}', "certificates[0].names",
     "unknown key 'names'"),
])
def test_bad_certificates_entry_names_file_line_and_key(tmp_path: Path, sni_pki, entries,
                                                       key, message):
    pki, certs = sni_pki
    files = {"bare": certs["bare"][0], "bare_key": certs["bare"][1], "api": certs["api"][0],
             "api_key": certs["api"][1], "wild": certs["wild"][0],
             "wild_key": certs["wild"][1]}
    config = write_config(tmp_path, free_port(), free_port(), (
        f'tls = {{ cert = "{pki.cert}", key = "{pki.key}", certificates = ['
        + entries.format(**{k: str(v) for k, v in files.items()}) + "] }"))
    out = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    line = next((text for text in (out.stdout + out.stderr).splitlines() if key in text), "")
    assert message in line, out.stdout + out.stderr
    tls_line = config.read_text().splitlines().index(
        next(t for t in config.read_text().splitlines() if t.startswith("tls = {"))) + 1
    assert f"{config}:{tls_line}:" in line  # the listener's tls line
