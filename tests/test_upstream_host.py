"""A cluster's `host`: the Host (HTTP/2 :authority) its endpoints get instead of the
client's, as a hosted model API behind a name needs (nginx's `proxy_set_header Host`,
Envoy's host_rewrite_literal). TLS to that name: tests/test_h2_upstream_tls.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.h2_support import H2Upstream, ProxyProc
from tests.support import aiproxy_cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def h2_up() -> Iterator[H2Upstream]:
    up = H2Upstream(name="h2-host")
    yield up
    up.stop()


def test_host_replaces_the_clients_host_over_http1_and_h2(
        demo_upstream: int, h2_up: H2Upstream, tmp_path: Path) -> None:
    proxy = ProxyProc(tmp_path, f"""
[[listeners]]
name = "p"
address = "127.0.0.1:{{p}}"
protocols = ["http1", "h2c"]

[[clusters]]
name = "h1"
endpoints = ["127.0.0.1:{demo_upstream}"]
host = "API.Example.com:8443"

[[clusters]]
name = "h2"
endpoints = ["127.0.0.1:{h2_up.port}"]
protocol = "h2"
host = "models.example.net"

[[clusters]]
name = "plain"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[routes]]
name = "h2"
match = {{ path_prefix = "/h2/" }}
cluster = "h2"

[[routes]]
name = "plain"
match = {{ path_prefix = "/plain/" }}
prefix_rewrite = "/"
cluster = "plain"

[[routes]]
name = "h1"
cluster = "h1"
""", ("p",))
    try:
        base = f"http://127.0.0.1:{proxy.ports['p']}"
        for http2 in (False, True):
            with httpx.Client(http1=not http2, http2=http2) as c:
                r = c.get(base + "/echo", headers={"host": "gateway.internal"})
                assert r.json()["headers"]["host"] == "api.example.com:8443"
                r = c.get(base + "/h2/echo", headers={"host": "gateway.internal"})
                assert r.json()["authority"] == "models.example.net"
                # A cluster without `host` still gets the client's.
                r = c.get(base + "/plain/echo", headers={"host": "gateway.internal"})
                assert r.json()["headers"]["host"] == "gateway.internal"
    finally:
        proxy.stop()


def test_bad_host_names_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("""[[listeners]]
name = "p"
address = "127.0.0.1:1"

[[clusters]]
name = "c"
endpoints = ["127.0.0.1:2"]
host = "bad host:99999"
""")
    r = aiproxy_cli("check", "-c", str(path))
    assert r.returncode != 0
    assert f"{path}:8: clusters[0].host: invalid host 'bad host:99999'" in r.stderr, r.stderr
