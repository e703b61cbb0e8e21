"""[kernel] config section: parsing and FILE:LINE errors (no root needed)."""

from __future__ import annotations

import pytest

from aiproxy.config import ConfigError, load_config_text

BASE = """\
[[listeners]]
name = "public"
address = "127.0.0.1:8080"

[[listeners]]
name = "grpc"
address = "127.0.0.1:50051"
"""


def load(text: str):
    return load_config_text(BASE + text, "k.toml")


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text)
    return [str(p) for p in info.value.problems]


def test_defaults_off():
    k = load("").kernel
    assert k.interfaces == () and not k.enabled and k.xdp_mode == "auto"
    assert k.syn_rate_per_source == 0 and k.syn_ports == ()


def test_full_section():
    k = load("""
[kernel]
interfaces = ["eth0", "eth1"]
xdp_mode = "native"
deny_cidrs = ["192.0.2.0/24", "2001:db8::/32", "198.51.100.7", "192.0.2.0/24"]
syn_rate_per_source = 50
syn_burst = 100
splice_tunnels = true

[[kernel.classes]]
name = "chat"
ports = [8080]
payload = ["post_v1"]
dscp = 46
priority = 6

[[kernel.classes]]
name = "grpc"
payload = ["h2_preface"]
ports = [50051]
dscp = 34
""").kernel
    assert k.interfaces == ("eth0", "eth1") and k.xdp_mode == "native" and k.enabled
    assert k.deny_cidrs == ("192.0.2.0/24", "2001:db8::/32", "198.51.100.7/32")
    assert (k.syn_rate_per_source, k.syn_burst, k.splice_tunnels) == (50, 100, True)
    assert k.syn_ports == (8080, 50051)  # default: the listeners' ports
    assert [(c.name, c.id, c.ports, c.payload, c.dscp, c.priority) for c in k.classes] == [
        ("chat", 1, (8080,), ("post_v1",), 46, 6),
        ("grpc", 2, (50051,), ("h2_preface",), 34, None),
    ]


def test_explicit_syn_ports():
    k = load('[kernel]\nsyn_rate_per_source = 5\nsyn_ports = [443]\n').kernel
    assert k.syn_ports == (443,)


def test_errors_name_file_line_and_key():
    got = problems("""
[kernel]
interfaces = ["eth0", "eth0", "bad/name"]
xdp_mode = "turbo"
deny_cidrs = ["10.0.0.1/8", "nonsense", 7]
syn_rate_per_source = -1
syn_ports = [0, 443]
bogus = 1
classes = [
  { name = "a", ports = [80], dscp = 64 },
  { name = "a", ports = [80], priority = 1 },
  { name = "c", payload = ["h3"], priority = 1 },
  { name = "d", dscp = 1 },
  { name = "e", ports = [81] },
]
""")
    expected = [
        "k.toml:10: kernel.interfaces[1]: duplicate interface 'eth0'",
        "k.toml:10: kernel.interfaces[2]: invalid interface name 'bad/name'",
        "k.toml:11: kernel.xdp_mode: unknown xdp_mode 'turbo' (allowed: auto, native, generic)",
        "k.toml:12: kernel.deny_cidrs[0]: invalid CIDR '10.0.0.1/8': 10.0.0.1/8 has host bits "
        "set (did you mean '10.0.0.0/8'?)",
        "k.toml:12: kernel.deny_cidrs[2]: expected string, got integer",
        "k.toml:13: kernel.syn_rate_per_source: must be between 0 and 1000000, got -1",
        "k.toml:14: kernel.syn_ports[0]: port must be between 1 and 65535, got 0",
        "k.toml:15: kernel.bogus: unknown key 'bogus'",
        "k.toml:17: kernel.classes[0].dscp: must be between 0 and 63, got 64",
        "k.toml:18: kernel.classes[1].ports: port 80 is already in class 'a'",
        "k.toml:18: kernel.classes[1].name: duplicate class name 'a' (first defined at line 17)",
        "k.toml:19: kernel.classes[2].payload[0]: unknown payload signature 'h3' (allowed: "
        "h2_preface, post_v1)",
        "k.toml:20: kernel.classes[3]: a class needs ports or payload to match anything",
        "k.toml:21: kernel.classes[4]: a class needs dscp or priority to mark anything",
    ]
    for line in expected:
        assert line in got, f"{line!r} not in {got}"
    assert any("nonsense" in p for p in got)


def test_too_many_classes():
    classes = ",".join(f'{{ name = "c{i}", ports = [{1000 + i}], dscp = 1 }}' for i in range(16))
    got = problems(f"[kernel]\nclasses = [{classes}]\n")
    assert any("at most 15 classes, got 16" in p for p in got)
