"""TLS to upstreams (cluster `tls`): nginx as the real TLS upstream, HTTP/1.1 and HTTP/2
chosen by ALPN, certificate and host-name verification against a CA made here, SNI, and
the failures (unknown CA, an upstream that does not agree to h2) as 502 JSON errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aiproxy.config import ConfigError, load_config
from tests.h2_support import FrameClient, Pki, ProxyProc, make_pki
from tests.support import free_port, start_process, stop_process, wait_port

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("openssl")),
                       reason="needs nginx and openssl"),
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nginx(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """nginx with two TLS servers: `h2` (ALPN h2 and http/1.1) and `h1` (no http2)."""
    d = tmp_path_factory.mktemp("nginx")
    ports = {"h2": free_port(), "h1": free_port()}
    body = '"$server_protocol $ssl_protocol sni=$ssl_server_name host=$http_host\\n"'
    conf = d / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        worker_processes 1;
        daemon off;
        error_log {d}/error.log;
        pid {d}/nginx.pid;
        events {{ worker_connections 256; }}
        http {{
          access_log off;
          ssl_certificate {pki.cert};
          ssl_certificate_key {pki.key};
          server {{ listen 127.0.0.1:{ports["h2"]} ssl http2;
                   location / {{ return 200 {body}; }} }}
          server {{ listen 127.0.0.1:{ports["h1"]} ssl;
                   location / {{ return 200 {body}; }} }}
        }}
        """))
    proc = start_process(["nginx", "-c", str(conf)])
    try:
        for port in ports.values():
            wait_port("127.0.0.1", port, proc=proc)
        yield ports
    finally:
        stop_process(proc)


CONFIG = """
[[listeners]]
name = "h1"
address = "127.0.0.1:{h1}"
protocols = ["http1"]

[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[clusters]]
name = "tls-h1"
endpoints = ["127.0.0.1:{ngx_h2}"]
tls = { ca = "{ca}" }

[[clusters]]
name = "tls-h2"
endpoints = ["127.0.0.1:{ngx_h2}"]
protocol = "h2"
tls = { ca = "{ca}", sni = "localhost" }

[[clusters]]
name = "noverify"
endpoints = ["127.0.0.1:{ngx_h2}"]
protocol = "h2"
tls = { verify = false }

[[clusters]]
name = "system-ca"
endpoints = ["127.0.0.1:{ngx_h2}"]
tls = true

[[clusters]]
name = "h2-to-h1-only"
endpoints = ["127.0.0.1:{ngx_h1}"]
protocol = "h2"
tls = { ca = "{ca}" }

[[clusters]]
name = "checked"
endpoints = ["127.0.0.1:{ngx_h2}"]
protocol = "h2"
tls = { ca = "{ca}" }
health_check = { path = "/", interval_ms = 100, unhealthy_threshold = 2 }

[[clusters]]
name = "checked-wrong-ca"
endpoints = ["127.0.0.1:{ngx_h1}"]
tls = true
health_check = { path = "/", interval_ms = 100, unhealthy_threshold = 2 }

[[clusters]]
name = "plain-to-tls"
endpoints = ["127.0.0.1:{ngx_h2}"]

[[routes]]
name = "tls-h2"
match = { host = "h2.test" }
cluster = "tls-h2"

[[routes]]
name = "noverify"
match = { host = "noverify.test" }
cluster = "noverify"

[[routes]]
name = "system-ca"
match = { host = "system.test" }
cluster = "system-ca"

[[routes]]
name = "h2-to-h1-only"
match = { host = "h1only.test" }
cluster = "h2-to-h1-only"

[[routes]]
name = "plain"
match = { host = "plain.test" }
cluster = "plain-to-tls"

[[routes]]
name = "all"
cluster = "tls-h1"
"""


@pytest.fixture(scope="module")
def proxy(nginx: dict[str, int], pki: Pki,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    text = (CONFIG.replace("{ngx_h2}", str(nginx["h2"])).replace("{ngx_h1}", str(nginx["h1"]))
            .replace("{ca}", str(pki.ca)))
    p = ProxyProc(tmp_path_factory.mktemp("tls-up"), text, ("h1", "h2c"))
    yield p
    p.stop()


def get(proxy: ProxyProc, host: str) -> httpx.Response:
    with httpx.Client(timeout=20) as client:
        return client.get(f"http://127.0.0.1:{proxy.ports['h1']}/x", headers={"host": host})


def test_http1_over_tls_verified(proxy: ProxyProc) -> None:
    r = get(proxy, "any.test")
    assert r.status_code == 200
    assert r.text.startswith("HTTP/1.1 TLSv1.")
    assert "host=any.test" in r.text


def test_h2_over_tls_alpn_and_sni(proxy: ProxyProc) -> None:
    for _ in range(3):  # the pooled connection is reused
        r = get(proxy, "h2.test")
        assert r.status_code == 200
        assert r.text.startswith("HTTP/2.0 TLSv1."), r.text
        assert "sni=localhost" in r.text


def test_h2_client_to_h2_tls_upstream(proxy: ProxyProc) -> None:
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/y", authority="h2.test"))
        resp = c.response(1)
    assert resp.status == 200 and resp.body.startswith(b"HTTP/2.0 TLSv1.")


def test_verify_false_accepts_any_certificate(proxy: ProxyProc) -> None:
    r = get(proxy, "noverify.test")
    assert r.status_code == 200 and r.text.startswith("HTTP/2.0")


def test_unknown_ca_is_a_502(proxy: ProxyProc) -> None:
    r = get(proxy, "system.test")
    assert r.status_code == 502
    doc = r.json()
    assert doc["error"]["code"] == "upstream_connect_failed"
    assert doc["error"]["message"].startswith("TLS handshake with the upstream failed:")


def test_upstream_without_h2_alpn_is_a_502(proxy: ProxyProc) -> None:
    r = get(proxy, "h1only.test")
    assert r.status_code == 502
    assert "ALPN" in r.json()["error"]["message"]


def test_plain_http_to_a_tls_port_fails_cleanly(proxy: ProxyProc) -> None:
    r = get(proxy, "plain.test")
    assert r.status_code == 400 or r.status_code >= 500  # nginx answers plain HTTP with 400


@pytest.mark.parametrize(("tls", "message"), [
    ("5", "clusters[0].tls: must be true, false or a table { ca, sni, verify }"),
    ('{ ca = "missing.pem" }', "clusters[0].tls.ca: no such file 'missing.pem'"),
    ("{ verify = false, ca = \"ca.pem\" }",
     "clusters[0].tls.verify: 'ca' is only used with verify = true"),
    ('{ sni = "bad host!" }', "clusters[0].tls.sni: invalid host name 'bad host!'"),
    ("{ cert = \"x\" }", "clusters[0].tls.cert: unknown key 'cert'"),
])
def test_cluster_tls_config_errors(tmp_path: Path, tls: str, message: str) -> None:
    (tmp_path / "ca.pem").write_text("x")
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(f"""\
        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"
        [[clusters]]
        name = "c"
        endpoints = ["127.0.0.1:9000"]
        tls = {tls}
        [[routes]]
        name = "r"
        cluster = "c"
        """))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert any(line.startswith(f"{path}:7: ") and message in line for line in lines), lines


def test_cluster_tls_config_forms(tmp_path: Path, pki: Pki) -> None:
    (tmp_path / "ca.pem").write_bytes(Path(pki.ca).read_bytes())
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent("""\
        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"
        [[clusters]]
        name = "t"
        endpoints = ["127.0.0.1:9000"]
        tls = true
        [[clusters]]
        name = "f"
        endpoints = ["127.0.0.1:9000"]
        tls = { ca = "ca.pem", sni = "api.internal" }
        [[routes]]
        name = "r"
        cluster = "t"
        """))
    cfg = load_config(path)
    t, f = cfg.clusters
    assert t.tls is not None and t.tls.verify and t.tls.ca is None and t.tls.sni is None
    assert f.tls.ca == str(tmp_path / "ca.pem") and f.tls.sni == "api.internal"
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(ConfigError, match="clusters.1..tls.ca: no PEM certificate"):
        load_config(path)


def test_check_command_accepts_a_tls_cluster(tmp_path: Path, pki: Pki) -> None:
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(f"""\
        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"
        [[clusters]]
        name = "t"
        endpoints = ["127.0.0.1:9000"]
        protocol = "h2"
        tls = {{ ca = "{pki.ca}" }}
        [[routes]]
        name = "r"
        cluster = "t"
        """))
    res = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_health_checks_use_tls(proxy: ProxyProc) -> None:
    """Checks of a TLS cluster go over TLS (HTTP/1.1 by ALPN, also for an h2 cluster):
    the endpoint with the right CA stays healthy, the one with an unknown CA does not."""
    deadline = time.monotonic() + 10
    while "checked-wrong-ca: 127.0.0.1" not in proxy.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = proxy.log()
    assert "cluster checked-wrong-ca: 127.0.0.1" in log and "is unhealthy" in log, log[-3000:]
    assert "cluster checked: " not in log, log[-3000:]


def host_config(port: int, ca: Path, protocol: str, host: str, tls: str = "",
                admin: int | None = None) -> str:
    """One listener ({p}), one TLS cluster to nginx's `port` with `host`, `tls` adding
    to its { ca } table, and an admin listener when `admin` is given."""
    admin_part = f'[admin]\naddress = "127.0.0.1:{admin}"\n' if admin else ""
    return f"""
[[listeners]]
name = "p"
address = "127.0.0.1:{{p}}"

{admin_part}
[[clusters]]
name = "c"
endpoints = ["127.0.0.1:{port}"]
protocol = "{protocol}"
tls = {{ ca = "{ca}"{tls} }}
host = "{host}"

[[routes]]
name = "r"
cluster = "c"
"""


@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_cluster_host_is_the_name_tls_asks_for_and_verifies(
        nginx: dict[str, int], pki: Pki, tmp_path: Path, protocol: str) -> None:
    """An endpoint given by IP address, its cluster's `host` a name: SNI and the
    certificate check use that name (without the port), Host carries it whole."""
    def start(host: str) -> ProxyProc:
        return ProxyProc(tmp_path, host_config(nginx["h2"], pki.ca, protocol, host), ("p",))

    proxy = start("localhost:8443")
    try:
        r = httpx.get(f"http://127.0.0.1:{proxy.ports['p']}/", headers={"host": "gw.test"})
        assert r.status_code == 200, r.text
        assert "sni=localhost host=localhost:8443" in r.text
    finally:
        proxy.stop()
    proxy = start("other.test")
    try:
        r = httpx.get(f"http://127.0.0.1:{proxy.ports['p']}/")
        # The client is told the name did not match; the log says which name.
        assert r.status_code == 502 and "mismatch" in r.json()["error"]["message"], r.text
        assert "other.test" not in r.text
        assert "not valid for 'other.test'" in proxy.log()
    finally:
        proxy.stop()


@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_reload_that_changes_host_or_tls_opens_new_connections(
        nginx: dict[str, int], pki: Pki, tmp_path: Path, protocol: str) -> None:
    """The connections a pool keeps were set up for its cluster's `host` and `tls`:
    after a reload that changes either, the next request goes over a new connection
    (new SNI, certificate checked against the new name), not a kept one."""
    admin = free_port()

    def config(host: str, tls: str) -> str:
        return host_config(nginx["h2"], pki.ca, protocol, host, tls, admin)

    proxy = ProxyProc(tmp_path, config("localhost", ""), ("p",))
    port = proxy.ports["p"]
    try:
        wait_port("127.0.0.1", admin)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            r = client.get("/")
            assert r.status_code == 200 and "sni=localhost host=localhost" in r.text, r.text
            for host, tls, want in (
                    ("other.test", "", 502),  # the name the certificate must match
                    ("localhost", "", 200),
                    ("localhost", ', sni = "other.test"', 502),
                    ("localhost", "", 200)):
                proxy.config_path.write_text(config(host, tls).replace("{p}", str(port)))
                r = httpx.post(f"http://127.0.0.1:{admin}/config/reload")
                assert r.status_code == 200, r.text
                seen = proxy.log().count("not valid for 'other.test'")
                r = client.get("/")
                assert r.status_code == want, (host, tls, r.text)
                if want == 502:  # checked against that name: the log says it
                    assert "mismatch" in r.json()["error"]["message"], r.text
                    assert proxy.log().count("not valid for 'other.test'") > seen
    finally:
        proxy.stop()


@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_reload_after_the_ca_file_changed_opens_new_connections(
        nginx: dict[str, int], pki: Pki, tmp_path: Path, protocol: str) -> None:
    """The same `ca` path with other bytes in it (a CA rotated in place) is a change of
    `tls` too: after the reload the kept connection, verified against the old CA, is not
    used; the next one is checked against the file as it is now."""
    admin = free_port()
    ca = tmp_path / "upstream-ca.pem"
    shutil.copy(pki.ca, ca)
    text = host_config(nginx["h2"], ca, protocol, "localhost", admin=admin)
    proxy = ProxyProc(tmp_path, text, ("p",))
    try:
        wait_port("127.0.0.1", admin)
        with httpx.Client(base_url=f"http://127.0.0.1:{proxy.ports['p']}") as client:
            assert client.get("/").status_code == 200
            for source, want in ((pki.ca.parent / "ca2.pem", 502), (pki.ca, 200)):
                shutil.copy(source, ca)
                r = httpx.post(f"http://127.0.0.1:{admin}/config/reload")
                assert r.status_code == 200, r.text
                r = client.get("/")
                assert r.status_code == want, (source.name, r.text)
    finally:
        proxy.stop()
