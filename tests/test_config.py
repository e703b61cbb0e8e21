import textwrap
import tomllib
from pathlib import Path

import pytest

from aiproxy.config import (
    ConfigError,
    Endpoint,
    HttpConfig,
    Problem,
    RouteMatch,
    load_config,
    load_config_text,
    summary,
)
from aiproxy.config.locate import KeyPath, Locator, format_path

from .support import aiproxy_cli

BASE = """\
[[listeners]]
name = "public"
address = "127.0.0.1:8080"

[[clusters]]
name = "backend"
endpoints = ["127.0.0.1:9000"]
"""

FULL = """\
# aiproxy example
[server]
workers = 4
drain_timeout_ms = 0

[http]
max_header_bytes = 65536
max_body_bytes = 0          # unlimited
x_forwarded = false

[[listeners]]
name = "public"
address = "0.0.0.0:8080"
protocols = ["http1"]
backlog = 512

[[listeners]]
name = "local6"
address = "[::1]:8081"

[admin]
address = "localhost:9901"

[[clusters]]
name = "chat"
endpoints = [
  "10.0.0.1:8000",
  { address = "chat.internal:8000", weight = 3 },
]
connect_timeout_ms = 250

[[clusters]]
name = "drained"
endpoints = []

[[routes]]
name = "chat"
cluster = "chat"
match = { path_prefix = "/v1/", method = ["post", "GET"], host = "API.Example.com", headers = { "X-Model-Intent" = "chat" } }

[[routes]]
name = "health"
cluster = "drained"
[routes.match]
path = "/healthz"
method = "get"

[[routes]]
name = "default"
cluster = "chat"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "aiproxy.toml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    prefix = f"{path}:"
    lines = str(info.value).splitlines()
    assert [str(problem) for problem in info.value.problems] == lines
    assert all(line.startswith(prefix) for line in lines), lines
    return [line[len(prefix) :] for line in lines]


def test_full_config_values_and_defaults(tmp_path):
    path = write(tmp_path, FULL)
    cfg = load_config(path)

    assert cfg.source == str(path)
    assert (cfg.server.workers, cfg.server.drain_timeout_ms) == (4, 0)
    assert cfg.http == HttpConfig(max_header_bytes=65536, max_body_bytes=0, x_forwarded=False)
    assert cfg.http.max_headers == 100 and cfg.http.header_timeout_ms == 60000 and cfg.http.via

    public, local6 = cfg.listeners
    assert (public.name, public.host, public.port) == ("public", "0.0.0.0", 8080)
    assert (public.protocols, public.backlog) == (("http1",), 512)
    assert (local6.address, local6.host, local6.port) == ("[::1]:8081", "::1", 8081)
    assert local6.backlog == 1024
    assert (cfg.admin.host, cfg.admin.port) == ("localhost", 9901)

    chat = cfg.cluster_by_name("chat")
    assert chat.endpoints == (Endpoint("10.0.0.1", 8000), Endpoint("chat.internal", 8000, 3))
    assert chat.connect_timeout_ms == 250 and chat.request_timeout_ms == 30000
    assert chat.balancer == "round_robin" and chat.max_idle_connections == 32
    assert cfg.cluster_by_name("drained").endpoints == ()
    with pytest.raises(KeyError):
        cfg.cluster_by_name("nope")

    assert [route.name for route in cfg.routes] == ["chat", "health", "default"]
    assert cfg.routes[0].match == RouteMatch(
        path_prefix=b"/v1/",
        method=(b"POST", b"GET"),
        host=b"api.example.com",
        headers=((b"x-model-intent", b"chat"),),
    )
    assert cfg.routes[1].match == RouteMatch(path=b"/healthz", method=(b"GET",))
    assert cfg.routes[2].match == RouteMatch()


def test_minimal_config_defaults(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.http == HttpConfig()
    assert cfg.admin is None and cfg.routes == ()
    assert cfg.listeners[0].protocols == ("http1",)


def test_summary(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    assert summary(cfg).splitlines() == [
        "listener public 0.0.0.0:8080 [http1]",
        "listener local6 [::1]:8081 [http1]",
        "admin localhost:9901",
        "cluster chat [10.0.0.1:8000, chat.internal:8000 weight=3] round_robin",
        "cluster drained [] round_robin",
        "route chat path_prefix=/v1/ method=POST,GET host=api.example.com"
        " header:x-model-intent=chat -> chat",
        "route health path=/healthz method=GET -> drained",
        "route default * -> chat",
    ]


def test_unknown_key_in_routes_block(tmp_path):
    text = BASE + textwrap.dedent("""
        [[routes]]
        name = "a"
        cluster = "backend"

        [[routes]]
        name = "b"
        clustr = "backend"
        """)
    assert problems(tmp_path, text) == [
        "13: routes[1].cluster: missing required key",
        "15: routes[1].clustr: unknown key 'clustr' (did you mean 'cluster'?)",
    ]


def test_unknown_key_in_inline_match(tmp_path):
    text = BASE + textwrap.dedent("""
        [[routes]]
        name = "a"
        cluster = "backend"
        match = { path = "/x", methods = "GET" }
        """)
    assert problems(tmp_path, text) == [
        "12: routes[0].match.methods: unknown key 'methods' (did you mean 'method'?)"
    ]


def test_unknown_top_level_key_without_suggestion(tmp_path):
    assert problems(tmp_path, BASE + "\n[zzz]\nx = 1\n") == ["9: zzz: unknown key 'zzz'"]


def test_wrong_types_in_http(tmp_path):
    text = BASE + textwrap.dedent("""
        [http]
        via = true
        max_headers = "100"
        header_timeout_ms = true
        x_forwarded = 1
        """)
    assert problems(tmp_path, text) == [
        "11: http.max_headers: expected integer, got string",
        "12: http.header_timeout_ms: expected integer, got boolean",
        "13: http.x_forwarded: expected boolean, got integer",
    ]


def test_out_of_range(tmp_path):
    text = BASE + "\n[http]\nmax_header_bytes = 10\nbody_timeout_ms = 0\n[server]\nworkers = 0\n"
    assert problems(tmp_path, text) == [
        "10: http.max_header_bytes: must be between 1024 and 1048576, got 10",
        "11: http.body_timeout_ms: must be >= 1, got 0",
        "13: server.workers: must be between 1 and 1024, got 0",
    ]


def test_unknown_cluster_in_second_route(tmp_path):
    text = BASE + textwrap.dedent("""
        [[clusters]]
        name = "other"
        endpoints = []

        [[routes]]
        name = "a"
        cluster = "backend"

        [[routes]]
        name = "b"
        cluster = "missing"
        """)
    assert problems(tmp_path, text) == [
        "19: routes[1].cluster: unknown cluster 'missing' (defined: backend, other)"
    ]


def test_bad_address_in_multiline_endpoints(tmp_path):
    text = BASE + textwrap.dedent("""
        [[clusters]]
        name = "pool"
        endpoints = [
          "10.0.0.1:80",
          "10.0.0.2",  # no port
          { address = "10.0.0.3:99999" },
        ]
        """)
    assert problems(tmp_path, text) == [
        "13: clusters[1].endpoints[1]: invalid address '10.0.0.2': expected host:port",
        "14: clusters[1].endpoints[2].address: invalid address '10.0.0.3:99999':"
        " port must be between 1 and 65535",
    ]


def test_bad_listener_address(tmp_path):
    text = '[[listeners]]\nname = "x"\naddress = "::1:80"\n'
    assert problems(tmp_path, text) == [
        "3: listeners[0].address: invalid address '::1:80': expected host:port"
    ]


def test_duplicates(tmp_path):
    text = textwrap.dedent("""\
        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"

        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"

        [[clusters]]
        name = "c"
        endpoints = ["h:1", "H:1"]

        [[clusters]]
        name = "c"
        endpoints = []

        [[routes]]
        name = "r"
        cluster = "c"

        [[routes]]
        name = "r"
        cluster = "c"
        match = { headers = { "X-A" = "1", "x-a" = "2" } }
        """)
    assert problems(tmp_path, text) == [
        "6: listeners[1].name: duplicate listener name 'a' (first defined at line 2)",
        "7: listeners[1].address: duplicate listener address '127.0.0.1:8080'"
        " (also used by listener 'a')",
        "11: clusters[0].endpoints[1]: duplicate endpoint 'H:1'",
        "14: clusters[1].name: duplicate cluster name 'c' (first defined at line 10)",
        "22: routes[1].name: duplicate route name 'r' (first defined at line 18)",
        "24: routes[1].match.headers.x-a: duplicate header 'x-a'",
    ]


def test_syntax_error(tmp_path):
    text = BASE + "\n[http]\nvia = tru\n"
    assert problems(tmp_path, text) == ["10: http.via: syntax: Invalid value"]


def test_syntax_error_at_end_of_document(tmp_path):
    assert problems(tmp_path, 'a = "x\n') == ["1: a: syntax: Illegal character '\\n'"]
    assert problems(tmp_path, '[[listeners]]\nname = "a"\nb = [1,\n') == [
        "3: listeners[0].b: syntax: Invalid value"
    ]


def test_syntax_error_names_the_statement_that_opened_a_bracket_or_quote(tmp_path):
    # tomllib fails where the unclosed value finally stops parsing (a later table
    # header); the problem points at the key whose value was left open.
    text = textwrap.dedent("""\
        [server]
        workers = 1

        [[clusters]]
        name = "b"
        endpoints = ["127.0.0.1:2",
        # a comment

        [[routes]]
        name = "r"
        """)
    assert problems(tmp_path, text) == [
        "6: clusters[0].endpoints: syntax: Invalid value at line 9:"
        " a bracket or quote opened here is not closed"
    ]
    text = '[server]\nworkers = """abc\n\nx = 1\n'
    assert problems(tmp_path, text) == [
        "2: server.workers: syntax: Unterminated string at line 4:"
        " a bracket or quote opened here is not closed"
    ]


def test_syntax_error_names_key_and_table(tmp_path):
    assert problems(tmp_path, "[server]\nworkers = 1 2\n") == [
        "2: server.workers: syntax: Expected newline or end of document after a statement"
    ]
    assert problems(tmp_path, "[server\nworkers = 1\n") == [
        "1: server: syntax: Expected ']' at the end of a table declaration"
    ]
    assert problems(tmp_path, "[http]\nvia = true\nvia = false\n") == [
        "3: http.via: syntax: Cannot overwrite a value"
    ]
    assert problems(tmp_path, "[[clusters]]\nname = 'a'\n[[clusters]]\nname = 1 1\n") == [
        "4: clusters[1].name: syntax: Expected newline or end of document after a statement"
    ]


def test_missing_required_keys_point_at_table_header(tmp_path):
    text = textwrap.dedent("""\
        [[listeners]]
        name = "public"

        [admin]

        [[clusters]]
        name = "c"
        """)
    assert problems(tmp_path, text) == [
        "1: listeners[0].address: missing required key",
        "4: admin.address: missing required key",
        "6: clusters[0].endpoints: missing required key",
    ]


def test_no_listeners(tmp_path):
    assert problems(tmp_path, "[server]\nworkers = 1\n") == [
        "1: listeners: at least one listener is required"
    ]


def test_missing_and_unreadable_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == f"{missing}: cannot read: No such file or directory"
    assert info.value.problems == [
        Problem(str(missing), 0, "", "cannot read: No such file or directory")
    ]


def test_route_match_validation(tmp_path):
    text = BASE + textwrap.dedent("""
        [[routes]]
        name = "r"
        cluster = "backend"
        [routes.match]
        path = "v1"
        path_prefix = "/a b"
        method = ["GET", "BAD METHOD", 3]
        host = "example.com:8080"
        headers = { "bad header" = "x", ok = 5 }
        """)
    assert problems(tmp_path, text) == [
        "13: routes[0].match.path: must start with '/'",
        "14: routes[0].match.path_prefix: must be printable ASCII without spaces (percent-encode)",
        "15: routes[0].match.method[1]: invalid method 'BAD METHOD': must be an HTTP token",
        "15: routes[0].match.method[2]: expected string, got integer",
        "16: routes[0].match.host: invalid host 'example.com:8080': must not include a port",
        "17: routes[0].match.headers.\"bad header\": invalid header name 'bad header':"
        " must be an HTTP token",
        "17: routes[0].match.headers.ok: expected string, got integer",
    ]


def test_listener_protocols_and_cluster_balancer(tmp_path):
    text = BASE.replace('8080"', '8080"\nprotocols = ["h3"]') + textwrap.dedent("""\
        balancer = "random"
        [[listeners]]
        name = "x"
        address = "127.0.0.1:1"
        protocols = []
        """)
    assert problems(tmp_path, text) == [
        "4: listeners[0].protocols[0]: unknown protocol 'h3' (allowed: http1, h2c, h2, tcp)",
        "9: clusters[0].balancer: unknown balancer 'random' (allowed: round_robin, "
            "least_request, ring_hash, maglev, llm_score)",
        "13: listeners[1].protocols: must not be empty",
    ]


def test_wrong_structure(tmp_path):
    text = 'listeners = "x"\nclusters = [1]\n[[http]]\nvia = true\n'
    assert problems(tmp_path, text) == [
        "1: listeners: expected array of tables, got string",
        "2: clusters[0]: expected table, got integer",
        "3: http: expected table, got array",
    ]


def test_many_problems_reported_together(tmp_path):
    text = textwrap.dedent("""\
        [http]
        max_headers = "lots"

        [[listeners]]
        name = "public"
        address = "nowhere"

        [[clusters]]
        name = "c"
        endpoints = ["a:1", "b"]
        retries = 3

        [[routes]]
        name = "r"
        cluster = "d"
        """)
    assert problems(tmp_path, text) == [
        "2: http.max_headers: expected integer, got string",
        "6: listeners[0].address: invalid address 'nowhere': expected host:port",
        "10: clusters[0].endpoints[1]: invalid address 'b': expected host:port",
        "11: clusters[0].retries: unknown key 'retries'",
        "15: routes[0].cluster: unknown cluster 'd' (defined: c)",
    ]


def test_load_config_text_uses_filename():
    with pytest.raises(ConfigError) as info:
        load_config_text("[server]\nworkers = 0\n", "inline.toml")
    assert [str(p) for p in info.value.problems] == [
        "inline.toml:1: listeners: at least one listener is required",
        "inline.toml:2: server.workers: must be between 1 and 1024, got 0",
    ]


TRICKY = '''\
title = """
[not.a.table]
x = 1 # not a comment
"""   # comment "with quotes"
lit = \'\'\'
[[also.not]]\'\'\'
"quoted.key" = 'value # not comment'
a.b."c d" = 1
arr = [ # comment ]
  [1, 2],   # nested
  "x]y",
  { k = "v", "n.m" = [3] },
]

[[outer]]
name = "o0"

[[outer]]
name = "o1"
[[outer.inner]]
v = 1
[[outer.inner]]
v = 2
[outer.tbl]
w = "\\"" # escaped quote
'''


def leaf_paths(value: object, path: KeyPath = ()) -> list[KeyPath]:
    found = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += leaf_paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += leaf_paths(item, path + (index,))
    return found


def test_locator_tricky_toml():
    locator = Locator(TRICKY)
    expected = {
        ("title",): 1,
        ("lit",): 5,
        ("quoted.key",): 7,
        ("a", "b", "c d"): 8,
        ("arr",): 9,
        ("arr", 0, 1): 10,
        ("arr", 1): 11,
        ("arr", 2, "k"): 12,
        ("arr", 2, "n.m", 0): 12,
        ("outer", 0, "name"): 16,
        ("outer", 1): 18,
        ("outer", 1, "inner", 0, "v"): 21,
        ("outer", 1, "inner", 1): 22,
        ("outer", 1, "inner", 1, "v"): 23,
        ("outer", 1, "tbl", "w"): 25,
        ("outer", 1, "missing"): 18,
        ("nothing",): 1,
    }
    assert {path: locator.line(path) for path in expected} == expected
    recorded = locator._lines
    assert [p for p in leaf_paths(tomllib.loads(TRICKY)) if p not in recorded] == []


def test_locator_crlf():
    locator = Locator(BASE.replace("\n", "\r\n"))
    assert locator.line(("clusters", 0, "endpoints", 0)) == 7


def test_format_path():
    assert format_path(("routes", 1, "match", "path_prefix")) == "routes[1].match.path_prefix"
    assert format_path(("clusters", 0, "endpoints", 1)) == "clusters[0].endpoints[1]"
    assert format_path(("a", "x.y")) == 'a."x.y"'


def test_h2_needs_tls_and_tls_files_exist(tmp_path):
    text = BASE.replace('8080"', '8080"\nprotocols = ["h2"]')
    assert problems(tmp_path, text) == [
        "4: listeners[0].protocols: 'h2' needs TLS: add tls = { cert, key }"
        " (use 'h2c' for cleartext HTTP/2)",
    ]
    text = BASE.replace('8080"', '8080"\nprotocols = ["h2", "http1"]\n'
                        'tls = { cert = "c.pem", key = "k.pem" }')
    assert problems(tmp_path, text) == [
        "5: listeners[0].tls.cert: no such file 'c.pem'",
        "5: listeners[0].tls.key: no such file 'k.pem'",
    ]


def test_grpc_match_and_upstream_protocol(tmp_path):
    text = BASE.replace('name = "backend"', 'name = "backend"\nprotocol = "h3"') + textwrap.dedent("""\
        [[routes]]
        name = "r"
        cluster = "backend"
        match = { grpc_service = "a/b" }
        """)
    assert problems(tmp_path, text) == [
        "7: clusters[0].protocol: unknown protocol 'h3' (allowed: http1, h2)",
        "12: routes[0].match.grpc_service: invalid grpc_service 'a/b'",
    ]


def test_routing_keys_values(tmp_path):
    cfg = load_config(write(tmp_path, BASE + """
[[clusters]]
name = "v2"
endpoints = [{ address = "127.0.0.1:9001", capacity = 8 }]
balancer = "llm_score"
hash_key = "header:X-User-Id"
max_requests = 10
health_check = { path = "/health", interval_ms = 100, unhealthy_threshold = 2 }
outlier_detection = { consecutive_failures = 3, base_ejection_ms = 500 }
load_metrics = { gauge = "vllm:num_requests_running", full = 16 }
[clusters.llm_score]
latency_weight = 0.5
tpm = 1000

[[routes]]
name = "split"
match = { host = "*.example.com", path_prefix = "/v1/", path_regex = "/v1/[a-z]+", query = { a = "1", b = true }, headers = { x-a = { regex = "a+" }, x-b = { present = false } } }
split = [{ cluster = "v2", weight = 80 }, { cluster = "backend", weight = 20 }]
sticky_header = "X-User-Id"
timeout_ms = 500
retries = { attempts = 2, on = ["503", "reset"], budget_pct = 10 }
request_headers_add = { X-Team = "blue" }
request_headers_remove = ["Cookie"]
response_headers_add = { x-served-by = "aiproxy" }
response_headers_remove = ["server"]
prefix_rewrite = "/v2/"
model = "gpt-4o-mini"
"""))
    v2 = cfg.cluster_by_name("v2")
    assert v2.balancer == "llm_score" and v2.hash_key == "header:x-user-id"
    assert v2.endpoints[0].capacity == 8 and v2.max_requests == 10
    assert v2.health_check.path == b"/health" and v2.health_check.unhealthy_threshold == 2
    assert v2.outlier_detection.consecutive_failures == 3
    assert v2.load_metrics.gauge == "vllm:num_requests_running" and v2.load_metrics.full == 16
    assert v2.load_metrics.path == b"/metrics"
    assert v2.llm_score.latency_weight == 0.5 and v2.llm_score.tpm == 1000
    route = cfg.routes[0]
    assert route.cluster is None and route.clusters == ("v2", "backend")
    assert [t.weight for t in route.split] == [80, 20]
    assert route.sticky_header == b"x-user-id" and route.timeout_ms == 500
    assert route.retries.attempts == 2 and route.retries.on == ("503", "reset")
    assert route.request_headers_add == ((b"x-team", b"blue"),)
    assert route.request_headers_remove == (b"cookie",)
    assert route.response_headers_remove == (b"server",)
    assert route.prefix_rewrite == b"/v2/" and route.model == b"gpt-4o-mini"
    m = route.match
    assert m.host == b"*.example.com" and m.path_regex == b"/v1/[a-z]+"
    assert m.query == ((b"a", b"1"), (b"b", None))
    assert m.header_rules == ((b"x-a", "regex", b"a+"), (b"x-b", "absent", b""))


def test_routing_keys_errors(tmp_path):
    text = BASE + """
[[clusters]]
name = "x"
endpoints = ["127.0.0.1:9001"]
balancer = "maglev"
hash_key = "cookie:a"
health_check = { path = "health" }

[[routes]]
name = "a"
cluster = "x"
split = [{ cluster = "nope", weight = 1 }, { cluster = "x", weight = -1 }]
match = { path_regex = "(", headers = { x-a = { regex = "a", present = true } } }
retries = { attempts = 2, on = ["timeout"] }
request_headers_add = { Host = "x" }
prefix_rewrite = "/y"
model = ""
"""
    assert problems(tmp_path, text) == [
        "13: clusters[1].hash_key: invalid hash_key 'cookie:a' (use \"header:<name>\" or "
        "\"client_ip\")",
        "14: clusters[1].health_check.path: must start with '/'",
        "19: routes[0].split: give one of cluster, split, direct_response or redirect, "
        "not cluster and split",
        "19: routes[0].split[0].cluster: unknown cluster 'nope' (defined: backend, x)",
        "19: routes[0].split[1].weight: must be between 0 and 1000000, got -1",
        "20: routes[0].match.headers.x-a: give exactly one of exact, regex, present",
        "20: routes[0].match.path_regex: invalid regular expression: RE2 syntax: missing ): (",
        "21: routes[0].retries.on[0]: unknown retry condition 'timeout' (allowed: "
        "connect-failure, reset, 502, 503, 504, unavailable)",
        "22: routes[0].request_headers_add.Host: header 'host' is managed by the proxy",
        "24: routes[0].model: must be non-empty printable ASCII without spaces",
    ]
    assert problems(tmp_path, BASE + """
[[routes]]
name = "a"
cluster = "backend"
match = { path = "/x" }
prefix_rewrite = "/y"
""") == ["13: routes[0].prefix_rewrite: needs match.path_prefix"]


# -- what `check` must catch so that `run` does not fail later ---------------------------


def test_numbers_no_key_can_take(tmp_path):
    text = BASE + textwrap.dedent("""\
        [http]
        max_body_bytes = 1000000000000000000000000000000

        [[ratelimits]]
        name = "rl"
        requests_per_second = nan
        """)
    assert problems(tmp_path, text) == [
        "9: http.max_body_bytes: integer beyond TOML's 64-bit range",
        "13: ratelimits[0].requests_per_second: must be a finite number, got nan",
    ]
    text = BASE.replace('8080"', '8080"\nbacklog = 100000000000')
    assert problems(tmp_path, text) == [
        "4: listeners[0].backlog: must be between 1 and 65535, got 100000000000"]


def test_ipv4_literal_must_be_an_address(tmp_path):
    text = BASE.replace("127.0.0.1:8080", "256.300.1.1:8080")
    assert problems(tmp_path, text) == [
        "3: listeners[0].address: invalid address '256.300.1.1:8080': "
        "invalid IPv4 address '256.300.1.1'"]


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "aiproxy.toml"
    path.write_bytes(BASE.encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:8: cannot read: not UTF-8 (byte 0xe9)"


def test_a_byte_order_mark_is_read_past(tmp_path):
    """Editors on Windows start UTF-8 files with U+FEFF; tomllib calls it an invalid
    statement on line 1."""
    path = tmp_path / "aiproxy.toml"
    path.write_bytes(b"\xef\xbb\xbf" + BASE.encode())
    assert load_config(path).listeners[0].address == "127.0.0.1:8080"
    path.write_bytes(b"\xef\xbb\xbf" + BASE.replace("8080", "80x").encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:3: listeners[0].address:"), info.value


def test_empty_strings_that_would_quietly_mean_the_default(tmp_path):
    text = BASE + textwrap.dedent("""\
        [admin]
        address = "127.0.0.1:9901"
        token = ""

        [tracing]
        service_name = ""
        """)
    assert problems(tmp_path, text) == [
        "10: admin.token: must not be empty (leave the key out for no token)",
        "13: tracing.service_name: must not be empty",
    ]


def test_log_paths_must_be_writable_files(tmp_path):
    (tmp_path / "adir").mkdir()
    text = BASE + textwrap.dedent("""\
        [access_log]
        path = "adir"

        [audit]
        path = "adir"
        """)
    assert problems(tmp_path, text) == [
        f"9: access_log.path: '{tmp_path / 'adir'}' is a directory",
        f"12: audit.path: '{tmp_path / 'adir'}' is a directory",
    ]
    text = BASE + '[access_log]\npath = "no/such/dir/access.log"\n'
    assert problems(tmp_path, text) == [
        f"9: access_log.path: no such directory '{tmp_path / 'no/such/dir'}'"]


def _pem_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_files_are_loaded_at_check_time(tmp_path):
    _pem_pair(tmp_path, "a")
    _pem_pair(tmp_path, "b")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")

    def tls(cert: str, key: str, ca: str | None = None) -> list[str]:
        extra = f', ca = "{ca}"' if ca else ""
        text = BASE.replace('8080"', f'8080"\nprotocols = ["h2"]\n'
                            f'tls = {{ cert = "{cert}", key = "{key}"{extra} }}')
        return problems(tmp_path, text)

    load_config(write(tmp_path, BASE.replace(
        '8080"', '8080"\nprotocols = ["h2"]\ntls = { cert = "a.crt", key = "a.key", '
        'ca = "b.crt" }')))
    assert tls("garbage.pem", "a.key")[0].startswith(
        "5: listeners[0].tls.cert: not a PEM certificate")
    assert tls("a.crt", "garbage.pem")[0].startswith(
        "5: listeners[0].tls.key: not an unencrypted PEM private key")
    assert tls("a.key", "a.crt")[0].startswith("5: listeners[0].tls.cert: not a PEM certificate")
    assert tls("a.crt", "b.key") == [
        "5: listeners[0].tls.key: does not fit the certificate (KEY_VALUES_MISMATCH)"]
    assert tls("a.crt", "a.key", "garbage.pem")[0].startswith(
        "5: listeners[0].tls.ca: no PEM certificate could be loaded")
    text = BASE.replace('endpoints = ["127.0.0.1:9000"]',
                        'endpoints = ["127.0.0.1:9000"]\ntls = { ca = "garbage.pem" }')
    assert problems(tmp_path, text)[0].startswith(
        "8: clusters[0].tls.ca: no PEM certificate could be loaded")


def test_jwks_file_is_read_at_check_time(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text('{"keys": [{"kty": "XX"}]}')
    text = BASE + textwrap.dedent("""\
        [auth.jwt]
        jwks_file = "bad.json"
        algorithms = ["RS256"]
        """)
    found = problems(tmp_path, text)
    assert len(found) == 1 and found[0].startswith(
        "9: auth.jwt.jwks_file: cannot load the JWKS: Expecting property name"), found
    found = problems(tmp_path, text.replace("bad.json", "empty.json"))
    assert len(found) == 1 and found[0].startswith(
        "9: auth.jwt.jwks_file: no usable key in the JWKS (key None skipped:"), found


def test_a_broken_auth_method_is_not_also_a_missing_one(tmp_path):
    (tmp_path / "jwks.json").write_text('{"keys": []}')
    text = BASE + textwrap.dedent("""\
        [auth.jwt]
        jwks_file = "missing.json"
        algorithms = ["RS256"]
        """)
    assert problems(tmp_path, text) == ["9: auth.jwt.jwks_file: no such file 'missing.json'"]
    text = BASE + textwrap.dedent("""\
        [[ratelimits]]
        name = "rl"
        requests_per_second = "5"
        """)
    assert problems(tmp_path, text) == [
        "10: ratelimits[0].requests_per_second: expected a number >= 0"]
    text = BASE + '[[ratelimits]]\nname = "rl"\nrequests_per_second = 0\n'
    assert problems(tmp_path, text) == [
        "8: ratelimits[0]: requests_per_second and tokens_per_minute cannot both be 0"]


def test_ring_hash_weights_are_bounded(tmp_path):
    """ring_hash puts 100 points per unit of weight on its ring, rebuilt at start and on
    every health change: a weight of a billion was accepted, then the worker tried to
    build 10^11 points. The sum is bounded; the other balancers take any weight."""
    text = BASE + textwrap.dedent("""\
        balancer = "ring_hash"

        [[clusters]]
        name = "rr"
        endpoints = [{ address = "127.0.0.1:9000", weight = 1000000000 }]
        """)
    text = text.replace('endpoints = ["127.0.0.1:9000"]',
                        'endpoints = [\n  "127.0.0.1:9000",\n'
                        '  { address = "127.0.0.1:9001", weight = 1000000000 },\n]')
    assert problems(tmp_path, text) == [
        "7: clusters[0].endpoints: ring_hash weights add up to 1000000001, at most 10000"
        " (100 ring points per unit; only their ratios matter: scale them down)",
    ]
    ok = text.replace("weight = 1000000000 },\n]", "weight = 9999 },\n]")
    cfg = load_config(write(tmp_path, ok))
    assert [e.weight for e in cfg.cluster_by_name("backend").endpoints] == [1, 9999]


def test_listener_and_admin_addresses_that_overlap(tmp_path):
    """"localhost" is the loopback address and 0.0.0.0 every IPv4 one: spelled apart from
    127.0.0.1 on the same port they passed `check`, then one process could not bind
    (exit 1) and workers, binding with SO_REUSEPORT, split connections between two
    listeners. [::] is IPv6 only (IPV6_V6ONLY: it meets localhost's ::1, not 127.0.0.1),
    and a host name is resolved only at start, so it overlaps nothing here."""
    text = textwrap.dedent("""\
        [[listeners]]
        name = "a"
        address = "127.0.0.1:8080"

        [[listeners]]
        name = "b"
        address = "localhost:8080"
        protocols = ["h2c"]

        [[listeners]]
        name = "c"
        address = "0.0.0.0:8080"

        [[listeners]]
        name = "v6"
        address = "[::]:8080"

        [[listeners]]
        name = "named"
        address = "proxy.internal:8080"

        [admin]
        address = "LOCALHOST:8081"

        [[listeners]]
        name = "d"
        address = "0.0.0.0:8081"
        """)
    assert problems(tmp_path, text) == [
        "7: listeners[1].address: address 'localhost:8080' overlaps listener 'a'"
        " (127.0.0.1:8080)",
        "12: listeners[2].address: address '0.0.0.0:8080' overlaps listener 'a'"
        " (127.0.0.1:8080)",
        "16: listeners[3].address: address '[::]:8080' overlaps listener 'b'"
        " (localhost:8080)",
        "23: admin.address: address 'LOCALHOST:8081' overlaps listener 'd' (0.0.0.0:8081)",
    ]


def test_key_file_syntax_error_names_its_line(tmp_path):
    """A broken `[auth] key_file` was reported as `FILE: cannot read key file: ... (at
    line 3, column 11)`: no FILE:LINE, and "cannot read" for a file that was read."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nid = "k1"\nsubject = "batch\nhash = "x"\n')
    path = write(tmp_path, BASE + '\n[auth]\nkey_file = "keys.toml"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        f"{keys}:3: keys[0].subject: syntax: Illegal character '\\n'"]
    keys.write_bytes(b'[[keys]]\nid = "k1"\nsubject = "\xff"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        f"{keys}:3: cannot read: not UTF-8 (byte 0xff)"]


def test_empty_audit_fsync_and_guard_action_are_errors(tmp_path):
    """`fsync = ""` and `action = ""` were taken as the defaults ("interval", "block")
    without a word, as if the key were absent."""
    text = BASE + textwrap.dedent(f"""\

        [audit]
        path = "{tmp_path}/audit.log"
        fsync = ""

        [[guard.rules]]
        id = "r"
        action = ""
        keywords = ["x"]
        """)
    assert problems(tmp_path, text) == [
        "11: audit.fsync: one of always, interval, never, got ''",
        "15: guard.rules[0].action: one of block, flag, got ''",
    ]


def test_regexes_must_be_re2_syntax(tmp_path):
    """Route and guard regexes run on client input in RE2 (linear time): what only a
    backtracking engine can do (lookaround, backreferences) is a config error naming the
    feature, not a pattern that can stall the worker."""
    text = BASE + textwrap.dedent("""\

        [[routes]]
        name = "a"
        cluster = "backend"
        match = { path_regex = '/v1/(?!admin).*' }

        [[routes]]
        name = "b"
        cluster = "backend"
        match = { headers = { x-tenant = { regex = '(?<=t-)[a-z]+' } } }

        [[routes]]
        name = "c"
        cluster = "backend"
        match = { headers = { x-t = { regex = '([a-z]+)-\\1' } } }

        [[guard.rules]]
        id = "r"
        regexes = ['ok', 'ignore(?= previous)', '(?P<k>[a-z]+)=(?P=k)', 'end\\Z']
        """)
    assert problems(tmp_path, text) == [
        "12: routes[0].match.path_regex: invalid regular expression: RE2 syntax: "
        "negative lookahead (?!...) not supported",
        "17: routes[1].match.headers.x-tenant.regex: invalid regular expression: RE2 syntax: "
        "lookbehind (?<=...) not supported",
        "22: routes[2].match.headers.x-t.regex: invalid regular expression: RE2 syntax: "
        "backreference \\1 not supported",
        "26: guard.rules[0].regexes[1]: invalid regex: RE2 syntax: lookahead (?=...) not "
        "supported",
        "26: guard.rules[0].regexes[2]: invalid regex: RE2 syntax: backreference (?P=...) "
        "not supported",
        "26: guard.rules[0].regexes[3]: invalid regex: RE2 syntax: \\Z not supported (use "
        "\\z for the end of the text)",
    ]
    # Patterns that backtrack catastrophically in `re` are fine: RE2 runs them in linear time.
    load_config(write(tmp_path, BASE + textwrap.dedent("""\

        [[routes]]
        name = "a"
        cluster = "backend"
        match = { path_regex = '/(a+)+', headers = { x-tenant = { regex = '([a-z]+)+' } } }
        """)))


def test_check_reports_a_lookahead_as_file_line_and_exit_2(tmp_path):
    path = write(tmp_path, BASE + textwrap.dedent("""\

        [[routes]]
        name = "a"
        cluster = "backend"
        match = { headers = { x-tenant = { regex = 'a(?=b)' } } }
        """))
    res = aiproxy_cli("check", "-c", str(path))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert (f"{path}:12: routes[0].match.headers.x-tenant.regex: invalid regular expression: "
            "RE2 syntax: lookahead (?=...) not supported") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "re2.cc" not in res.stderr, res.stderr


@pytest.mark.parametrize("token", ["abc ", "abc\\t", "a\\nb", "a\\u007fb"])
def test_admin_token_a_client_cannot_send(tmp_path, token):
    """A token ending in a space passed `check`, and every admin request then got 401:
    HTTP strips a field value's trailing whitespace and carries no control bytes."""
    text = BASE + f'\n[admin]\naddress = "127.0.0.1:9901"\ntoken = "{token}"\n'
    assert problems(tmp_path, text) == [
        "11: admin.token: must not contain control characters or end with whitespace "
        "(no client could send it)"]
    text = BASE + '\n[admin]\naddress = "127.0.0.1:9901"\ntoken = " s3cr3t with\tspace/+="\n'
    assert load_config(write(tmp_path, text)).admin.token == " s3cr3t with\tspace/+="


def test_duplicate_listener_protocol(tmp_path):
    text = BASE.replace('8080"', '8080"\nprotocols = ["http1", "h2c", "http1"]')
    assert problems(tmp_path, text) == ["4: listeners[0].protocols[2]: duplicate protocol 'http1'"]


def test_semantic_threshold_needs_a_semantic_section(tmp_path):
    """Without [semantic] there are no embeddings to compare: the threshold would do
    nothing, silently."""
    text = BASE + "\n[cache]\nsemantic_threshold = 0.9\n"
    assert problems(tmp_path, text) == [
        "10: cache.semantic_threshold: needs a [semantic] section"]


@pytest.mark.parametrize("listener, endpoint", [
    ("127.0.0.1:8080", "127.0.0.1:8080"),
    ("0.0.0.0:8080", "127.0.0.1:8080"),
    ("0.0.0.0:8080", "127.0.0.5:8080"),
    ("0.0.0.0:8080", "localhost:8080"),
    ("127.0.0.1:8080", "localhost:8080"),
    ("[::]:8080", "[::1]:8080"),
    ("localhost:8080", "127.0.0.1:8080"),
])
def test_cluster_endpoint_that_is_an_own_listener_is_a_loop(tmp_path, listener, endpoint):
    """Proxying to the listener the request came in on sends it round until its headers
    outgrow the limit (431 after ~100 hops): refused at load. Another port of the
    proxy, or a non-loopback address (maybe another host), stays allowed."""
    text = BASE.replace('"127.0.0.1:8080"', f'"{listener}"').replace(
        '"127.0.0.1:9000"', f'"127.0.0.1:9000", "{endpoint}"')
    assert problems(tmp_path, text) == [
        f"7: clusters[0].endpoints[1]: endpoint '{endpoint}' is this proxy's own listener "
        f"'public' ({listener}): requests would loop back into it"]


@pytest.mark.parametrize("listener, endpoint", [
    ("127.0.0.1:8080", "127.0.0.1:8081"),
    ("127.0.0.1:8080", "127.0.0.2:8080"),
    ("0.0.0.0:8080", "192.0.2.7:8080"),
    ("0.0.0.0:8080", "[::1]:8080"),
    ("0.0.0.0:8080", "upstream.example:8080"),
])
def test_cluster_endpoint_beside_an_own_listener_is_allowed(tmp_path, listener, endpoint):
    text = BASE.replace('"127.0.0.1:8080"', f'"{listener}"').replace(
        '"127.0.0.1:9000"', f'"{endpoint}"')
    assert load_config_text(textwrap.dedent(text), "x.toml").clusters[0].endpoints[0].port \
        == int(endpoint.rsplit(":", 1)[1])


def test_llm_api_prefixes(tmp_path):
    cfg = load_config(write(tmp_path, BASE + """
[llm]
api_prefixes = ["/v1/", "/openai/v1/", "/openai/deployments/*/", "/v1/"]
"""))
    assert cfg.llm.api_prefixes == ("/v1/", "/openai/v1/", "/openai/deployments/*/")
    assert load_config(write(tmp_path, BASE + "[llm]\n")).llm.api_prefixes == ("/v1/",)
    assert problems(tmp_path, BASE + """
[llm]
api_prefixes = [
  "openai/v1/",
  "/openai/v1",
  "/openai/deployments/gpt*/",
  "/v1/?x=1/",
  "/open ai/",
  3,
]
""") == [
        "11: llm.api_prefixes[0]: must start and end with '/', got 'openai/v1/'",
        "12: llm.api_prefixes[1]: must start and end with '/', got '/openai/v1'",
        "13: llm.api_prefixes[2]: '*' stands only for a whole path segment, "
        "got '/openai/deployments/gpt*/'",
        "14: llm.api_prefixes[3]: a path prefix has no query or fragment, got '/v1/?x=1/'",
        "15: llm.api_prefixes[4]: must be printable ASCII without spaces (percent-encode "
        "others), got '/open ai/'",
        "16: llm.api_prefixes[5]: expected string, got integer",
    ]
    assert problems(tmp_path, BASE + "[llm]\napi_prefixes = []\n") == [
        '9: llm.api_prefixes: give at least one prefix (default ["/v1/"])']
