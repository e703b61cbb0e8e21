"""A TLS listener's certificate renewed on disk (as certbot does) and SIGHUP: new
handshakes get the new certificate, a connection already up keeps working, and a
certificate/key pair that does not load rejects the reload while the last good one
keeps serving. One process and `workers = 2` (real processes, real TLS clients)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CRASH_MARKERS
from tests.h2_support import make_pki
from tests.support import free_port, start_process, stop_process, wait_port

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def renewed_cert(d: Path) -> tuple[Path, Path]:
    """A second server certificate from the same CA, with its own key and serial."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "renewed.key", "-out", "renewed.csr", "-subj", "/CN=renewed", cwd=d)
    _openssl("x509", "-req", "-in", "renewed.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "renewed.pem", "-days", "2", "-extfile",
             "server.ext", cwd=d)
    return d / "renewed.pem", d / "renewed.key"


def der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def install(src: Path, dst: Path) -> None:
    """Write a new file and rename it over the path, as certbot and most tools do."""
    tmp = dst.with_suffix(".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def connect(port: int, ca: Path) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    conn.connect()
    return conn


def get(conn: http.client.HTTPSConnection) -> int:
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    resp.read()
    return resp.status


def served_cert(port: int, ca: Path) -> bytes:
    conn = connect(port, ca)
    try:
        assert get(conn) == 200
        cert = conn.sock.getpeercert(binary_form=True)
    finally:
        conn.close()
    return cert


def wait_log(proc: subprocess.Popen, text: str, count: int, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
        if log.count(text) >= count:
            return log
        assert proc.poll() is None, f"proxy exited:\n{log}"
        assert time.monotonic() < deadline, f"no {count} x {text!r} in the log:\n{log}"
        time.sleep(0.05)


RELOADED = ("config reloaded (", "config reloaded in")  # one process, workers


def start_tls_proxy(tmp_path: Path, upstream: int, workers: int, protocols: list[str],
                    tls: str) -> tuple[subprocess.Popen, int]:
    """A proxy process with one TLS listener (`tls`: its inline table) in front of
    `upstream`, serving in every worker; (process, port)."""
    port = free_port()
    config = tmp_path / "aiproxy.toml"
    config.write_text(f"""
[server]
workers = {workers}
drain_timeout_ms = 2000

[[listeners]]
name = "tls"
address = "127.0.0.1:{port}"
protocols = {json.dumps(protocols)}
tls = {tls}

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{upstream}"]

[[routes]]
name = "all"
cluster = "up"
""")
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(config)])
    try:
        wait_port("127.0.0.1", port, timeout=60, proc=proc)
        if workers > 1:
            wait_log(proc, "is serving", workers, timeout=60)
    except BaseException:
        stop_process(proc)
        raise
    return proc, port


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_reloads_a_renewed_certificate(tmp_path: Path, demo_upstream, workers: int):
    pki = make_pki(tmp_path / "pki")
    new_cert, new_key = renewed_cert(pki.ca.parent)
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "cert.pem", live / "key.pem"
    shutil.copyfile(pki.cert, cert)
    shutil.copyfile(pki.key, key)
    proc, port = start_tls_proxy(tmp_path, demo_upstream, workers, ["h2", "http1"],
                                 f'{{ cert = "{cert}", key = "{key}" }}')
    reloaded = RELOADED[workers > 1]
    try:
        old = der(pki.cert)
        assert served_cert(port, pki.ca) == old
        kept = connect(port, pki.ca)  # up across the reload
        assert get(kept) == 200

        install(new_cert, cert)
        install(new_key, key)
        proc.send_signal(signal.SIGHUP)
        log = wait_log(proc, reloaded, 1)
        # Every new handshake, whichever worker takes it, presents the new certificate.
        for _ in range(12):
            assert served_cert(port, pki.ca) == der(new_cert)
        assert log.count("TLS certificate reloaded") == workers
        assert get(kept) == 200  # the connection from before carries on
        assert kept.sock.getpeercert(binary_form=True) == old

        # A key that does not fit the certificate: the reload is rejected, naming the
        # file's key in the config, and the last good certificate keeps serving.
        install(pki.client_key, key)
        proc.send_signal(signal.SIGHUP)
        log = wait_log(proc, "reload rejected", 1)
        assert "listeners[0].tls.key: does not fit the certificate" in log
        for _ in range(6):
            assert served_cert(port, pki.ca) == der(new_cert)
        assert get(kept) == 200

        # Fixed again: back to the original pair.
        install(pki.cert, cert)
        install(pki.key, key)
        proc.send_signal(signal.SIGHUP)
        wait_log(proc, reloaded, 2)
        for _ in range(12):
            assert served_cert(port, pki.ca) == old
        kept.close()
    finally:
        log = stop_process(proc, timeout=15)
    assert not [m for m in CRASH_MARKERS if m in log], log


def mtls_status(port: int, pki, cert: tuple[Path, Path]) -> int | str:
    """The status of a request made with this client certificate, or how the handshake
    (or the first read, in TLS 1.3) was refused."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(*cert)
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.connect()
        return get(conn)
    except (ssl.SSLError, ConnectionError) as exc:
        return type(exc).__name__
    finally:
        conn.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_ca_dropped_from_the_bundle_is_no_longer_trusted_after_a_reload(
        tmp_path: Path, demo_upstream, workers: int):
    """Rotating the client CA bundle (mTLS) and reloading: certificates of the CA that
    left the bundle are refused from the next handshake on (it stayed trusted until a
    restart: OpenSSL adds to a context's store, never removes)."""
    pki = make_pki(tmp_path / "pki")
    ca2 = pki.ca.parent / "ca2.pem"
    bundle = tmp_path / "clients-ca.pem"
    shutil.copyfile(pki.ca, bundle)
    client = (pki.client_cert, pki.client_key)  # issued by ca
    other = (pki.other_client_cert, pki.other_client_key)  # issued by ca2
    proc, port = start_tls_proxy(tmp_path, demo_upstream, workers, ["http1"],
                                 f'{{ cert = "{pki.cert}", key = "{pki.key}", ca = "{bundle}" }}')
    reloaded = RELOADED[workers > 1]
    try:
        assert mtls_status(port, pki, client) == 200
        assert mtls_status(port, pki, other) != 200

        install(ca2, bundle)  # ca out, ca2 in
        proc.send_signal(signal.SIGHUP)
        wait_log(proc, reloaded, 1)
        for _ in range(6):  # whichever worker takes the handshake
            assert mtls_status(port, pki, client) != 200
            assert mtls_status(port, pki, other) == 200
    finally:
        log = stop_process(proc, timeout=15)
    assert not [m for m in CRASH_MARKERS if m in log], log
