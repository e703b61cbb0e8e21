"""[policy]: RBAC + ABAC rules through a running proxy, live reload (latency measured and
logged), broken files, dry-run, time-limited grants, `aiproxy policy explain`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from aiproxy.config import ConfigError
from aiproxy.governance.auth import hash_key
from aiproxy.governance.policy import Request, decide, load_policy_files
from tests.conftest import simple_config
from tests.support import raw_exchange

KEYS = {"alice": ("ak_alice_0123456789abcdef", ["analyst"]),
        "bob": ("ak_bob_0123456789abcdefgh", ["intern"]),
        "ops": ("ak_ops_0123456789abcdefgh", ["admin"])}

POLICY = """
default = "deny"

[roles]
analyst = ["route:all", "model:gpt-4o*", "intent:*"]
intern = ["route:all", "model:tiny-*"]
admin = ["*"]

[[rules]]
id = "no-delete"
effect = "deny"
methods = ["DELETE"]
roles = ["analyst", "intern"]

[[rules]]
id = "big-bodies"
effect = "deny"
body_over = 1000
subjects = ["bob"]

[[rules]]
id = "rbac"
effect = "allow"
rbac = true
"""


def _config(upstream: int, policy_file: Path, extra: str = "") -> str:
    keys = "".join(
        f'\n[[auth.api_keys]]\nid = "{name}"\nsubject = "{name}"\nhash = "{hash_key(key)}"\n'
        f"roles = {roles!r}\n".replace("'", '"')
        for name, (key, roles) in KEYS.items())
    return simple_config(upstream) + f"""
[auth]
{keys}

[policy]
files = ["{policy_file}"]
poll_ms = 50
{extra}
"""


def _req(client: httpx.Client, proxy, who: str, method: str = "POST", model: str = "gpt-4o",
         body_pad: int = 0) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "x" * body_pad}]}
    return client.request(method, f"{proxy.url}/echo", json=body,
                          headers={"x-api-key": KEYS[who][0]})


@pytest.fixture
def policy_proxy(start_proxy, demo_upstream, tmp_path):
    pf = tmp_path / "policy.toml"
    pf.write_text(POLICY)
    proxy = start_proxy(_config(demo_upstream, pf))
    proxy.policy_file = pf
    return proxy


def _assert_403(r: httpx.Response, rule: str) -> None:
    assert r.status_code == 403, r.text
    assert r.json()["error"] == {"code": "forbidden", "message": f"denied by policy rule {rule}"}
    assert r.headers["x-aiproxy-policy-rule"] == rule


def test_rbac_and_abac_decisions(policy_proxy):
    with httpx.Client(timeout=10) as c:
        assert _req(c, policy_proxy, "alice").status_code == 200
        _assert_403(_req(c, policy_proxy, "alice", model="tiny-1"), "default")  # no permission
        assert _req(c, policy_proxy, "bob", model="tiny-1").status_code == 200
        _assert_403(_req(c, policy_proxy, "bob", model="gpt-4o"), "default")
        _assert_403(_req(c, policy_proxy, "bob", model="tiny-1", body_pad=2000), "big-bodies")
        _assert_403(_req(c, policy_proxy, "alice", method="DELETE"), "no-delete")
        # Methods are case-sensitive on the wire, but an upstream may upper-case one:
        # a rule about DELETE covers `delete` too.
        raw = raw_exchange(policy_proxy.port, (
            f"delete /echo HTTP/1.1\r\nHost: x\r\nx-api-key: {KEYS['alice'][0]}\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n").encode())
        assert raw.startswith(b"HTTP/1.1 403 ") and b"no-delete" in raw, raw[:300]
        # deny overrides allow: admin is not in the deny rule's roles, so only rbac applies
        assert _req(c, policy_proxy, "ops", method="DELETE", model="any").status_code == 200


def test_policy_change_takes_effect_quickly_and_broken_file_keeps_old(policy_proxy):
    pf = policy_proxy.policy_file
    latencies = []
    with httpx.Client(timeout=10) as c:
        for round_ in range(3):
            assert _req(c, policy_proxy, "alice").status_code == 200
            changed = POLICY + f"""
[[rules]]
id = "lockout-{round_}"
effect = "deny"
subjects = ["alice"]
"""
            tmp = pf.with_suffix(".new")
            tmp.write_text(changed)
            t0 = time.monotonic()
            tmp.replace(pf)
            # A running client, one request every 5 ms, until it is denied.
            while True:
                r = _req(c, policy_proxy, "alice")
                if r.status_code == 403:
                    break
                assert time.monotonic() - t0 < 5, "policy change never applied"
                time.sleep(0.005)
            latencies.append((time.monotonic() - t0) * 1000)
            _assert_403(r, f"lockout-{round_}")
            pf.write_text(POLICY)
            deadline = time.monotonic() + 5
            while _req(c, policy_proxy, "alice").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        print(f"policy reload latency ms (change -> first denial): "
              f"{', '.join(f'{x:.0f}' for x in latencies)}")
        assert max(latencies) < 2000  # generous bound; the target (300 ms) is what is logged
        # A broken file is rejected with FILE:LINE and the previous policy keeps serving.
        pf.write_text(POLICY + '\n[[rules]]\nid = "x"\neffect = "maybe"\n')
        time.sleep(0.4)
        assert _req(c, policy_proxy, "alice").status_code == 200
        _assert_403(_req(c, policy_proxy, "alice", method="DELETE"), "no-delete")
    log = policy_proxy.log()
    assert "policy not reloaded" in log
    assert f"{pf}:" in log and "rules[3].effect" in log


def test_idle_proxy_picks_up_a_changed_policy_file(policy_proxy):
    """No request comes: a timer still re-reads the files (the kernel deny map follows
    them, see tests/test_policy_xdp.py)."""
    # Every worker holds its own policy and its own timer: change the file once all of
    # them have read it, and wait for each to re-read it.
    workers = policy_proxy.workers()
    pf = policy_proxy.policy_file
    tmp = pf.with_suffix(".new")
    tmp.write_text(POLICY + '\n[[rules]]\nid = "idle"\neffect = "deny"\nmethods = ["PUT"]\n')
    tmp.replace(pf)
    deadline = time.monotonic() + 5
    while policy_proxy.log().count("policy reloaded from") < workers:
        assert time.monotonic() < deadline, policy_proxy.log()
        time.sleep(0.05)
    for _ in range(workers * 4):  # new connections spread over the workers
        with httpx.Client(timeout=10) as c:
            _assert_403(_req(c, policy_proxy, "ops", method="PUT"), "idle")


def test_dry_run_logs_would_deny(start_proxy, demo_upstream, tmp_path):
    pf = tmp_path / "policy.toml"
    pf.write_text(POLICY)
    proxy = start_proxy(_config(demo_upstream, pf, "dry_run = true"))
    with httpx.Client(timeout=10) as c:
        assert _req(c, proxy, "alice", method="DELETE").status_code == 200
    deadline = time.monotonic() + 3
    while "dry-run: would deny DELETE /echo for alice (rule no-delete)" not in proxy.log():
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)


def test_a_file_replaced_while_a_worker_starts_is_picked_up(tmp_path, monkeypatch):
    """A worker that reads the old file while it is being replaced must not stamp the new
    one as seen (CI caught worker 0 of 2 keeping the old rules for good)."""
    from aiproxy.governance import policy as policy_mod

    pf = tmp_path / "policy.toml"
    pf.write_text(POLICY)
    real_load = policy_mod.load_policy_files

    def load_then_replace(files):
        loaded = real_load(files)
        tmp = pf.with_suffix(".new")
        tmp.write_text(POLICY + '\n[[rules]]\nid = "late"\neffect = "deny"\nmethods = ["PUT"]\n')
        tmp.replace(pf)
        monkeypatch.setattr(policy_mod, "load_policy_files", real_load)
        return loaded

    monkeypatch.setattr(policy_mod, "load_policy_files", load_then_replace)
    state = policy_mod.PolicyState((str(pf),), dry_run=False, poll_ms=50,
                                   inspect_bytes=1024 * 1024)
    assert [r.id for r in state.policy.rules][-1] == "rbac"
    state.watch.checked = float("-inf")  # the next poll is due
    assert [r.id for r in state.current().rules][-1] == "late"


def test_time_limited_grants_and_conditions(tmp_path):
    now = datetime(2026, 1, 5, 10, 30, tzinfo=UTC)  # a Monday
    pf_text = """
[roles]
user = ["route:all"]

[[rules]]
id = "temp"
effect = "allow"
subjects = ["carol"]
expires = 2026-01-05T11:00:00Z

[[rules]]
id = "office-hours"
effect = "allow"
roles = ["user"]
time = { days = ["mon", "tue"], from = "09:00", to = "17:00" }
source_cidrs = ["192.0.2.0/24", "2001:db8::/32"]

[[rules]]
id = "gold"
effect = "allow"
claims = { tier = ["gold", "platinum"] }
rbac = true
"""
    path = tmp_path / "policy.toml"
    path.write_text(pf_text)
    policy = load_policy_files([str(path)])
    ts = now.timestamp()
    assert decide(policy, Request(subject="carol", now=ts)).rule == "temp"
    assert decide(policy, Request(subject="carol", now=ts + 3600)).allowed is False
    office = Request(subject="u", roles=("user",), source="192.0.2.9", now=ts)
    assert decide(policy, office).rule == "office-hours"
    office.source = "198.51.100.1"
    assert not decide(policy, office).allowed
    office.source = "2001:db8::1"
    office.now = (now + timedelta(days=5)).timestamp()  # Saturday
    assert not decide(policy, office).allowed
    office.now = ts
    assert decide(policy, office).allowed
    # A token's own time-limited grant (aiproxy_grants) and a claim condition.
    claims = {"tier": "gold", "aiproxy_grants": [{"permission": "route:all", "exp": ts + 60}]}
    req = Request(subject="d", claims=claims, route="all", now=ts)
    assert decide(policy, req).rule == "gold"
    req.now = ts + 120
    assert not decide(policy, req).allowed
    req.claims = {"tier": "silver", "aiproxy_grants": claims["aiproxy_grants"]}
    req.now = ts
    assert not decide(policy, req).allowed


def test_broken_policy_file_at_startup_names_file_and_line(tmp_path):
    pf = tmp_path / "p.toml"
    pf.write_text('[[rules]]\nid = "a"\neffect = "allow"\n\n[[rules]]\nid = "b"\n'
                  'effect = "deny"\nsource_cidrs = ["10.0.0.300/8"]\n')
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(pf)])
    assert f"{pf}:8: rules[1].source_cidrs[0]: invalid CIDR" in str(err.value)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[listeners]]\nname = "a"\naddress = "127.0.0.1:1"\n[policy]\n'
                   f'files = ["{pf}"]\n')
    res = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(cfg)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and f"{pf}:8:" in res.stderr, res.stderr


@pytest.mark.parametrize("rest", ["", '\n\n[[rules]]\nid = "b"\neffect = "deny"\n'])
def test_policy_syntax_error_names_the_statement_that_opened_it(tmp_path, rest):
    """tomllib reports an unclosed array where parsing gave up (a later line, or the end
    of the document with no line at all): the policy file's error names the statement
    that opened it, as the main config's does."""
    pf = tmp_path / "p.toml"
    pf.write_text('default = "deny"\n[[rules]]\nid = "a"\neffect = "allow"\n'
                  'methods = ["GET"' + rest)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[listeners]]\nname = "a"\naddress = "127.0.0.1:1"\n[policy]\n'
                   f'files = ["{pf}"]\n')
    res = subprocess.run([sys.executable, "-m", "aiproxy", "check", "-c", str(cfg)],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"{pf}:5: rules[0].methods: syntax: "), res.stderr
    assert "Traceback" not in res.stderr


def test_duplicate_rule_id_is_one_problem_at_its_id(tmp_path):
    """In one file or across two: one problem, at the second id, naming the first."""
    one = tmp_path / "one.toml"
    one.write_text('[[rules]]\nid = "x"\neffect = "allow"\n'
                   '[[rules]]\nid = "x"\neffect = "deny"\n')
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(one)])
    assert str(err.value) == (f"{one}:5: rules[1].id: duplicate rule id 'x' "
                              f"(first at {one}:2)")
    two = tmp_path / "two.toml"
    two.write_text('[[rules]]\nid = "y"\neffect = "deny"\n\n'
                   '[[rules]]\nid = "x"\neffect = "deny"\n')
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(one), str(two)])
    assert str(err.value).splitlines()[1:] == [
        f"{two}:6: rules[1].id: duplicate rule id 'x' (first at {one}:2)"]


def test_explain_cli(tmp_path):
    pf = tmp_path / "p.toml"
    pf.write_text(POLICY)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[listeners]]\nname = "a"\naddress = "127.0.0.1:1"\n[policy]\n'
                   f'files = ["{pf}"]\n')

    def explain(request: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aiproxy", "policy", "explain", "-c",
                               str(cfg), "--request", request], capture_output=True, text=True)

    res = explain('{"subject": "alice", "roles": ["analyst"], "method": "DELETE", '
                  '"route": "all", "model": "gpt-4o"}')
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "decision: deny (rule no-delete)"
    assert any("no-delete" in ln and "match" in ln and f"{pf}:9" in ln for ln in lines), lines
    assert any("rbac" in ln and "match" in ln for ln in lines)  # the allow it overrode
    res = explain('{"subject": "bob", "roles": ["intern"], "route": "all", "model": "gpt-4o"}')
    assert res.returncode == 1 and "decision: deny (rule default)" in res.stdout
    assert "no: rbac.model" in res.stdout
    res = explain('{"subject": "bob", "roles": ["intern"], "route": "all", "model": "tiny-2"}')
    assert res.returncode == 0 and "decision: allow (rule rbac)" in res.stdout
    assert explain('{"bogus": 1}').returncode == 2


def test_grpc_permission_denied(start_proxy, demo_upstream, tmp_path):
    import grpc

    pf = tmp_path / "policy.toml"
    pf.write_text(POLICY)
    proxy = start_proxy(_config(demo_upstream, pf), 'protocols = ["http1", "h2c"]')
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/pkg.Svc/Method")(
                b"x" * 2000, timeout=10, metadata=[("x-api-key", KEYS["bob"][0])])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert err.value.details() == "denied by policy rule big-bodies"


def test_intent_rules_judge_what_the_request_says(start_proxy, demo_upstream, tmp_path):
    """A rule on domains reads the model's intent for the body: also where no route
    needed one, and also when the client names another in the intent header (which
    routes by it, but is only its sender's claim)."""
    pf = tmp_path / "policy.toml"
    pf.write_text('default = "allow"\n\n[[rules]]\nid = "no-banking"\neffect = "deny"\n'
                  'domains = ["banking"]\n')
    proxy = start_proxy(_config(demo_upstream, pf, extra="[semantic]\n"))

    def ask(text: str, headers: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{proxy.url}/echo", timeout=10, json={
            "messages": [{"role": "user", "content": text}]},
            headers={"x-api-key": KEYS["alice"][0], **headers})

    transfer = "transfer 100 dollars from my checking account to my savings account"
    _assert_403(ask(transfer, {}), "no-banking")
    _assert_403(ask(transfer, {"x-model-intent": "greeting"}), "no-banking")
    assert ask("hello there, how are you today", {}).status_code == 200


def test_hostile_json_bodies_are_answered_without_a_traceback(start_proxy, demo_upstream,
                                                              tmp_path):
    """Found by fuzzing, every filter that reads a body on: JSON nested past the parser's
    recursion limit (a RecursionError, not a ValueError) and a lone-surrogate escape
    (\\ud800, which json accepts and UTF-8 cannot encode) each failed a filter (500, or a
    reset connection) and logged tracebacks. The start_proxy fixture fails the test on
    any traceback in the log."""
    pf = tmp_path / "policy.toml"
    pf.write_text('default = "allow"\n\n[[rules]]\nid = "no-big-model"\neffect = "deny"\n'
                  'models = ["gpt-5*"]\n')
    proxy = start_proxy(_config(demo_upstream, pf, extra="[semantic]\n\n[llm]\n\n[cache]\n"))
    deep = b'{"model":"m","messages":' + b"[" * 3000 + b"]" * 3000 + b"}"
    lone = b'{"model":"m","messages":[{"role":"user","content":"\\ud800 hi \\udfff"}]}'
    with httpx.Client(timeout=10, headers={"x-api-key": KEYS["alice"][0]}) as c:
        for ctype in ("application/json", "text/plain"):
            r = c.post(f"{proxy.url}/v1/chat/completions", content=deep,
                       headers={"content-type": ctype})
            # Passed on: the demo upstream's own parser fails it (aiohttp's 500 page).
            assert "filter_error" not in r.text and "Server got itself" in r.text, r.text
        r = c.post(f"{proxy.url}/v1/chat/completions", content=lone,
                   headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert c.post(f"{proxy.url}/echo", json={"model": "m"}).status_code == 200


def test_bearer_denials_say_insufficient_scope(start_proxy, demo_upstream, tmp_path):
    """RFC 6750 3.1: a valid bearer token that lacks the privileges a request needs gets
    403 with `WWW-Authenticate: Bearer error="insufficient_scope"`, and `scope` names
    the missing permissions when the policy knows them (an rbac rule). A credential sent
    in the API key header is no bearer token: its 403 carries no challenge."""
    import json

    import grpc
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k", "use": "sig"}]}))
    pf = tmp_path / "policy.toml"
    pf.write_text(POLICY)
    text = _config(demo_upstream, pf).replace("[auth]\n", '[auth]\nrealm = "corp"\n')
    proxy = start_proxy(text + f"""
[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256"]
""", 'protocols = ["http1", "h2c"]')
    token = jwt.encode({"sub": "carol", "roles": ["intern"], "exp": int(time.time()) + 300},
                       private, "RS256", headers={"kid": "k"})
    bearer = {"authorization": f"Bearer {token}"}
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{proxy.url}/echo", json={"model": "tiny-1"}, headers=bearer)
        assert r.status_code == 200, r.text
        r = c.post(f"{proxy.url}/echo", json={"model": "gpt-4o"}, headers=bearer)
        _assert_403(r, "default")
        assert r.headers["www-authenticate"] == (
            'Bearer realm="corp", error="insufficient_scope", scope="model:gpt-4o"')
        # A deny rule: no permission would help, so no scope to name.
        r = c.delete(f"{proxy.url}/echo", headers=bearer)
        _assert_403(r, "no-delete")
        assert r.headers["www-authenticate"] == 'Bearer realm="corp", error="insufficient_scope"'
        # An API key as the bearer token is one too.
        r = c.post(f"{proxy.url}/echo", json={"model": "gpt-4o"},
                   headers={"authorization": f"Bearer {KEYS['bob'][0]}"})
        _assert_403(r, "default")
        assert 'error="insufficient_scope", scope="model:gpt-4o"' in r.headers["www-authenticate"]
        # A model name that is no scope-token (RFC 6750 3: no space, quote or backslash,
        # let alone a line break) is not echoed: the challenge goes without scope.
        r = c.post(f"{proxy.url}/echo", json={"model": 'gpt "4"\r\nx-evil: 1'}, headers=bearer)
        _assert_403(r, "default")
        assert r.headers["www-authenticate"] == 'Bearer realm="corp", error="insufficient_scope"'
        assert "x-evil" not in r.headers
        # The API key header: a 403 as before, with no Bearer challenge.
        r = _req(c, proxy, "bob", model="gpt-4o")
        _assert_403(r, "default")
        assert "www-authenticate" not in r.headers
    # No role, so not even route:all: to a gRPC caller still PERMISSION_DENIED.
    token = jwt.encode({"sub": "dan", "exp": int(time.time()) + 300}, private, "RS256",
                       headers={"kid": "k"})
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/pkg.Svc/Method")(
                b"x", timeout=10, metadata=[("authorization", f"Bearer {token}")])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert err.value.details() == "denied by policy rule default"


def _jwt_proxy(start_proxy, upstream: int, tmp_path: Path, policy: str,
               auth_extra: str = "", listener_extra: str = ""):
    """A proxy with [auth.jwt] (an RSA key in a JWKS file) and `policy`; returns it and
    sign(claims) -> a token for it."""
    import json

    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k", "use": "sig"}]}))
    pf = tmp_path / "policy.toml"
    pf.write_text(policy)
    proxy = start_proxy(simple_config(upstream) + f"""
[auth]
realm = "corp"
{auth_extra}

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256"]

[policy]
files = ["{pf}"]
""", listener_extra)
    proxy.policy_file = pf

    def sign(claims: dict) -> str:
        return jwt.encode({"sub": "u", "exp": int(time.time()) + 300, **claims}, private,
                          "RS256", headers={"kid": "k"})

    return proxy, sign


def test_claims_match_by_json_type(start_proxy, demo_upstream, tmp_path):
    """A claim condition compares JSON types: a TOML boolean matches a JSON boolean, a
    number a number (1 and 1.0 are one JSON number), a string a string; a claim that is
    an array matches when one element does. Compared as str() on both sides, the deny
    rule `suspended = true` also hit the string "True" and missed nothing else, while
    `level = [0, 1.5]` missed 0.0 (fail open) and hit the string "0"."""
    proxy, sign = _jwt_proxy(start_proxy, demo_upstream, tmp_path, """
default = "allow"

[[rules]]
id = "suspended"
effect = "deny"
claims = { suspended = true }

[[rules]]
id = "level"
effect = "deny"
claims = { level = [0, 1.5] }

[[rules]]
id = "contractors"
effect = "deny"
claims = { groups = "contractors" }

[[rules]]
id = "flag-as-text"
effect = "deny"
claims = { flag = "true" }
""")

    def status(claims: dict) -> tuple[int, str | None]:
        r = httpx.post(f"{proxy.url}/echo", json={"model": "m"}, timeout=10,
                       headers={"authorization": f"Bearer {sign(claims)}"})
        return r.status_code, r.headers.get("x-aiproxy-policy-rule")

    assert status({}) == (200, None)
    assert status({"suspended": True}) == (403, "suspended")
    assert status({"suspended": False}) == (200, None)
    assert status({"suspended": "True"}) == (200, None)
    assert status({"suspended": 1}) == (200, None)
    assert status({"level": 0}) == (403, "level")
    assert status({"level": 0.0}) == (403, "level")
    assert status({"level": 1.5}) == (403, "level")
    assert status({"level": "0"}) == (200, None)
    assert status({"level": False}) == (200, None)  # a JSON boolean is no number
    assert status({"groups": ["staff", "contractors"]}) == (403, "contractors")
    assert status({"groups": ["staff"]}) == (200, None)
    assert status({"groups": "contractors"}) == (403, "contractors")
    assert status({"flag": "true"}) == (403, "flag-as-text")
    # The string "true" is not the boolean true. That cannot be told from the file, so
    # the first such claim is logged, naming the rule and where it is written.
    for _ in range(5):
        assert status({"flag": True}) == (200, None)
    log = proxy.log()
    warning = (f"policy rule flag-as-text ({proxy.policy_file}:19): claim flag is a "
               "JSON boolean, the rule's values are strings: no match")
    assert 1 <= log.count(warning) <= proxy.workers(), log[-3000:]  # once per worker


def test_claim_values_that_can_never_match_are_errors(tmp_path):
    """A claim value no JWT claim can equal is a config error naming FILE:LINE and key:
    TOML date-times (JSON has none), nan and inf, tables in arrays or arrays in arrays,
    an empty list, and registered claims of another type than RFC 7519 4.1 gives them
    (exp/nbf/iat are numbers, iss/sub/jti/aud strings)."""
    pf = tmp_path / "p.toml"
    pf.write_text("""[[rules]]
id = "a"
effect = "deny"
claims = { since = 2026-01-01T00:00:00Z }

[[rules]]
id = "b"
effect = "deny"
claims = { score = nan, cap = inf }

[[rules]]
id = "c"
effect = "deny"
claims = { nested = [[1]], objs = [{ a = 1 }], none = [] }

[[rules]]
id = "d"
effect = "deny"
claims = { exp = "1700000000", sub = 5, aud = ["x", true] }

[[rules]]
id = "e"
effect = "allow"
claims = { tier = ["gold", 1], ok = true, n = -2.5, "iss" = "https://issuer" }
""")
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(pf)])
    text = str(err.value)
    for line, key, why in (
            (4, "rules[0].claims.since", "a date-time"),
            (9, "rules[1].claims.score", "nan"),
            (9, "rules[1].claims.cap", "inf"),
            (14, "rules[2].claims.nested[0]", "an array"),
            (14, "rules[2].claims.objs[0]", "a table"),
            (14, "rules[2].claims.none", "an empty list"),
            (19, "rules[3].claims.exp", "a number"),
            (19, "rules[3].claims.sub", "a string"),
            (19, "rules[3].claims.aud[1]", "a string")):
        assert any(ln.startswith(f"{pf}:{line}: {key}: ") and why in ln
                   for ln in text.splitlines()), (key, text)
    assert "rules[4]" not in text, text


def test_nested_and_namespaced_claims(start_proxy, demo_upstream, tmp_path):
    """A TOML dotted key is a path into the token's JSON (Keycloak's realm_access.roles,
    resource_access.CLIENT.roles); a quoted key is one claim name, dots and all (Auth0's
    namespaced "https://example.com/roles"); the two combine. Before, a nested claim
    could not be named at all: a deny rule on one never matched."""
    proxy, sign = _jwt_proxy(start_proxy, demo_upstream, tmp_path, """
default = "allow"

[[rules]]
id = "realm-banned"
effect = "deny"
claims = { realm_access.roles = "banned" }

[[rules]]
id = "namespaced"
effect = "deny"
claims = { "https://example.com/roles" = "banned" }

[[rules]]
id = "free-tier"
effect = "deny"
claims."https://example.com/app".plan.tier = "free"

[[rules]]
id = "client-role"
effect = "deny"
[rules.claims.resource_access.billing]
roles = ["suspended", "closed"]
""")

    def rule(claims: dict) -> str | None:
        r = httpx.post(f"{proxy.url}/echo", json={"model": "m"}, timeout=10,
                       headers={"authorization": f"Bearer {sign(claims)}"})
        assert r.status_code == (200 if "x-aiproxy-policy-rule" not in r.headers else 403)
        return r.headers.get("x-aiproxy-policy-rule")

    assert rule({"realm_access": {"roles": ["offline_access", "banned"]}}) == "realm-banned"
    assert rule({"realm_access": {"roles": ["offline_access"]}}) is None
    assert rule({"realm_access": ["banned"]}) is None  # no member "roles" to look in
    assert rule({"realm_access.roles": ["banned"]}) is None  # a path, not that name
    assert rule({"https://example.com/roles": ["banned"]}) == "namespaced"
    assert rule({"https://example": {"com/roles": ["banned"]}}) is None  # one name
    assert rule({"https://example.com/app": {"plan": {"tier": "free"}}}) == "free-tier"
    assert rule({"https://example.com/app": {"plan": {"tier": "pro"}}}) is None
    assert rule({"resource_access": {"billing": {"roles": ["closed"]},
                                     "account": {"roles": ["view"]}}}) == "client-role"
    assert rule({"resource_access": {"account": {"roles": ["closed"]}}}) is None


def test_claim_paths_in_explain_and_errors(tmp_path):
    """`policy explain` names a claim condition by its path as TOML writes it; a table
    that names no claim, or members of a registered claim (a number or a string), are
    errors with FILE:LINE."""
    pf = tmp_path / "p.toml"
    pf.write_text('[[rules]]\nid = "a"\neffect = "allow"\n'
                  'claims = { realm_access.roles = "admin", "https://x.io/tier" = "gold" }\n')
    policy = load_policy_files([str(pf)])
    trace = decide(policy, Request(claims={"realm_access": {"roles": ["admin"]}}),
                   explain=True).trace
    assert trace == [("a", "allow", 'no: claims."https://x.io/tier"')]
    req = Request(claims={"realm_access": {"roles": "admin"}, "https://x.io/tier": "gold"})
    assert decide(policy, req).rule == "a"
    pf.write_text('[[rules]]\nid = "a"\neffect = "deny"\nclaims = { x = {} }\n\n'
                  '[[rules]]\nid = "b"\neffect = "deny"\nclaims.exp.at = 1\n')
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(pf)])
    lines = str(err.value).splitlines()
    assert any(ln.startswith(f"{pf}:4: rules[0].claims.x: an empty table") for ln in lines), lines
    assert any(ln.startswith(f"{pf}:9: rules[1].claims.exp: exp is a number")
               for ln in lines), lines


def test_anonymous_denial_that_credentials_could_lift_is_a_challenge(
        start_proxy, demo_upstream, tmp_path):
    """RFC 9110 15.5.2, RFC 6750 3.1: a request that carried no credentials, denied where
    credentials could make it succeed ([auth] required = false and an allow rule that
    only wants an identity), is 401 with the bare challenge (no error code: the client
    may not know auth is needed), not a 403 that says nothing of how to get in. A denial
    no identity would lift (a deny rule, or allow rules failing on more than the
    identity) stays 403; so does a policy with no [auth] to authenticate with."""
    import grpc

    proxy, sign = _jwt_proxy(start_proxy, demo_upstream, tmp_path, """
default = "deny"

[[rules]]
id = "no-delete"
effect = "deny"
methods = ["DELETE"]

[[rules]]
id = "open"
effect = "allow"
paths = ["/echo/open"]

[[rules]]
id = "staff"
effect = "allow"
methods = ["POST"]
claims = { realm_access.roles = "staff" }
""", auth_extra="required = false", listener_extra='protocols = ["http1", "h2c"]')
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{proxy.url}/echo", json={"model": "m"})
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == 'Bearer realm="corp"'
        assert r.json()["error"] == {"code": "unauthorized",
                                     "message": "credentials required by policy rule default"}
        assert r.headers["x-aiproxy-policy-rule"] == "default"
        assert c.get(f"{proxy.url}/echo/open").status_code == 200
        # No identity makes a GET pass (staff wants POST), nor a DELETE (a deny rule).
        r = c.get(f"{proxy.url}/echo")
        _assert_403(r, "default")
        assert "www-authenticate" not in r.headers
        r = c.delete(f"{proxy.url}/echo/open")
        _assert_403(r, "no-delete")
        assert "www-authenticate" not in r.headers
        # With the credentials the challenge asked for, in and out as before.
        staff = sign({"realm_access": {"roles": ["staff"]}})
        r = c.post(f"{proxy.url}/echo", json={"model": "m"},
                   headers={"authorization": f"Bearer {staff}"})
        assert r.status_code == 200, r.text
        r = c.post(f"{proxy.url}/echo", json={"model": "m"},
                   headers={"authorization": f"Bearer {sign({})}"})
        _assert_403(r, "default")
        assert r.headers["www-authenticate"] == 'Bearer realm="corp", error="insufficient_scope"'
    res = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %header{www-authenticate}",
                          "-X", "POST", "--data", "{}", f"{proxy.url}/echo"],
                         capture_output=True, text=True, timeout=30)
    assert res.stdout == '401 Bearer realm="corp"', res
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/pkg.Svc/Method")(b"x", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    # No [auth]: nothing to authenticate with, so a plain 403.
    pf = tmp_path / "noauth.toml"
    pf.write_text('[[rules]]\nid = "staff"\neffect = "allow"\nroles = ["staff"]\n')
    plain = start_proxy(simple_config(demo_upstream) + f'\n[policy]\nfiles = ["{pf}"]\n')
    r = httpx.post(f"{plain.url}/echo", json={"model": "m"}, timeout=10)
    _assert_403(r, "default")
    assert "www-authenticate" not in r.headers


def test_scope_claim_matches_by_scope_token(start_proxy, demo_upstream, tmp_path):
    """RFC 8693 4.2 (and RFC 9068 2.2.3 for JWT access tokens): `scope` is one string of
    space-separated scopes, so `scope = "ai:chat"` matches "openid ai:chat" as it would
    the array ["openid", "ai:chat"]. Compared as a whole, an allow on a scope missed
    every token with more than one, and a deny on one failed open."""
    proxy, sign = _jwt_proxy(start_proxy, demo_upstream, tmp_path, """
[[rules]]
id = "no-guests"
effect = "deny"
claims = { scope = "guest" }

[[rules]]
id = "chat"
effect = "allow"
claims = { scope = "ai:chat" }
""")

    def rule(claims: dict) -> str | None:
        r = httpx.post(f"{proxy.url}/echo", json={"model": "m"}, timeout=10,
                       headers={"authorization": f"Bearer {sign(claims)}"})
        return r.headers.get("x-aiproxy-policy-rule") or str(r.status_code)

    assert rule({"scope": "ai:chat"}) == "200"
    assert rule({"scope": "openid ai:chat profile"}) == "200"
    assert rule({"scope": ["openid", "ai:chat"]}) == "200"
    assert rule({"scope": "openid ai:chat-admin"}) == "default"
    assert rule({"scope": "ai:chat guest"}) == "no-guests"
    # Only the registered top-level claim: any other string is one value.
    assert rule({"scope": "openid", "x": {"scope": "ai:chat guest"}}) == "default"
    pf = tmp_path / "bad.toml"
    pf.write_text('[[rules]]\nid = "a"\neffect = "allow"\nclaims = { scope = "a b" }\n')
    with pytest.raises(ConfigError) as err:
        load_policy_files([str(pf)])
    assert str(err.value).startswith(f"{pf}:4: rules[0].claims.scope: "), str(err.value)


# -- what the rules read of a body: all of it, or a bound on the rest -------------------------


def _chat_body(model_json: str, pad: int, tail: str = "") -> bytes:
    """A chat body: `model_json` members first, `pad` bytes of prompt, `tail` members last."""
    return (f'{{{model_json}"messages": [{{"role": "user", "content": "{"x" * pad}"}}]'
            f'{tail}}}').encode()


def test_the_model_is_read_from_the_whole_body_not_its_start(policy_proxy):
    """alice may use gpt-4o* only. A body longer than the 64 KiB once read whose start
    names gpt-4o (nested, or as the first of two `model` keys: an upstream's JSON parser
    keeps the last), or names no model at all, was judged on that start and allowed."""
    pad = 80_000
    bodies = {
        "nested model first": _chat_body('"metadata": {"model": "gpt-4o"}, "model": "tiny-1", ',
                                         pad),
        "model after the prompt": _chat_body("", pad, ', "model": "tiny-1"'),
        "second model key": _chat_body('"model": "gpt-4o", ', pad, ', "model": "tiny-1"'),
    }
    with httpx.Client(timeout=10) as c:
        for what, body in bodies.items():
            r = c.post(f"{policy_proxy.url}/echo", content=body,
                       headers={"x-api-key": KEYS["alice"][0],
                                "content-type": "application/json"})
            assert r.status_code == 403, (what, r.status_code, r.text[:200])
            assert r.headers["x-aiproxy-policy-rule"] == "default", what
        ok = c.post(f"{policy_proxy.url}/echo", content=_chat_body('"model": "gpt-4o", ', pad),
                    headers={"x-api-key": KEYS["alice"][0], "content-type": "application/json"})
        assert ok.status_code == 200, ok.text[:200]


def test_a_body_past_inspect_bytes_is_refused_where_its_model_matters(start_proxy, demo_upstream,
                                                                      tmp_path):
    """Past [policy] inspect_bytes the model could only be guessed: 413 where a rule that
    reads it holds in all else (alice's rbac rule), not where none does (a route no model
    rule is about)."""
    pf = tmp_path / "policy.toml"
    pf.write_text("""
default = "allow"
[roles]
analyst = ["route:all", "model:gpt-4o*"]
[[rules]]
id = "models"
effect = "deny"
models = ["secret*"]
subjects = ["alice"]
""")
    proxy = start_proxy(_config(demo_upstream, pf, "inspect_bytes = 4096"))
    body = _chat_body('"model": "gpt-4o", ', 10_000, ', "model": "secret-1"')

    def post_in_two(who: str) -> bytes:
        """The body in two writes: the policy runs on the first 6,000 bytes."""
        head = (f"POST /echo HTTP/1.1\r\nHost: x\r\nx-api-key: {KEYS[who][0]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(head + body[:6000])
            time.sleep(0.3)
            try:
                s.sendall(body[6000:])
            except OSError:
                pass  # refused already, and closed
            out = b""
            while data := s.recv(65536):
                out += data
        return out

    out = post_in_two("alice")
    assert out.startswith(b"HTTP/1.1 413 "), out[:300]
    assert b'"policy_body_too_large"' in out and b"4096" in out, out
    # bob: no rule about models holds for him, so the model does not matter.
    out = post_in_two("bob")
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]
    with httpx.Client(timeout=10) as c:
        # Within the limit the whole body is read: the last model key is the one judged.
        small = _chat_body('"model": "gpt-4o", ', 1000, ', "model": "secret-1"')
        r = c.post(f"{proxy.url}/echo", content=small,
                   headers={"x-api-key": KEYS["alice"][0], "content-type": "application/json"})
        assert r.status_code == 403 and r.headers["x-aiproxy-policy-rule"] == "models"


SIZE_POLICY = """
default = "allow"
[[rules]]
id = "too-big"
effect = "deny"
body_over = 100000
"""


def test_body_over_holds_for_a_chunked_body(start_proxy, demo_upstream, tmp_path):
    """A body of unknown length was judged by the bytes held when the policy ran (none, on
    a policy without model rules): a chunked 2 MB body passed body_over = 100000."""
    pf = tmp_path / "policy.toml"
    pf.write_text(SIZE_POLICY)
    proxy = start_proxy(_config(demo_upstream, pf))

    def chunks(n: int):
        for _ in range(n // 10_000):
            yield b"y" * 10_000

    with httpx.Client(timeout=10) as c:
        r = c.post(f"{proxy.url}/echo", content=chunks(2_000_000),
                   headers={"x-api-key": KEYS["alice"][0]})
        assert r.status_code == 403, r.text[:300]
        assert r.headers["x-aiproxy-policy-rule"] == "too-big"
        r = c.post(f"{proxy.url}/echo", content=chunks(50_000),
                   headers={"x-api-key": KEYS["alice"][0]})
        assert r.status_code == 200, r.text[:300]


def test_body_over_past_inspect_bytes_is_held_as_the_body_streams(start_proxy, demo_upstream,
                                                                  tmp_path):
    """Past inspect_bytes the request goes upstream, allowed on its start; the body is
    then held to the deny rule's bound: once past it, 413 naming the rule."""
    pf = tmp_path / "policy.toml"
    pf.write_text(SIZE_POLICY.replace("100000", "5000"))
    proxy = start_proxy(_config(demo_upstream, pf, "inspect_bytes = 4096"))
    head = (f"POST /echo HTTP/1.1\r\nHost: x\r\nx-api-key: {KEYS['alice'][0]}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(head + b"%x\r\n" % 4500 + b"y" * 4500 + b"\r\n")
        time.sleep(0.3)  # allowed on these 4,500 bytes, and sent upstream
        s.sendall(b"%x\r\n" % 1000 + b"y" * 1000 + b"\r\n0\r\n\r\n")
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            out += data
    assert out.startswith(b"HTTP/1.1 413 "), out[:300]
    assert b"policy rule too-big" in out, out
    # Within the bound the same way in passes.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(head + b"%x\r\n" % 4500 + b"y" * 4500 + b"\r\n")
        time.sleep(0.3)
        s.sendall(b"%x\r\n" % 400 + b"y" * 400 + b"\r\n0\r\n\r\n")
        out = s.recv(65536)
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]


def test_only_a_file_that_sets_the_default_changes_it(start_proxy, demo_upstream, tmp_path):
    """Of several files the last default set counts. A file was taken to set it when the
    word "default" was anywhere in it (a comment, a rule id): a second file that only
    added a deny rule reset the first file's `default = "allow"` to deny."""
    base = tmp_path / "base.toml"
    base.write_text('default = "allow"\n')
    extra = tmp_path / "extra.toml"
    extra.write_text('# the default stays as base.toml sets it\n'
                     '[[rules]]\nid = "no-default-delete"\neffect = "deny"\n'
                     'methods = ["DELETE"]\n')
    proxy = start_proxy(simple_config(demo_upstream)
                        + f'\n[policy]\nfiles = ["{base}", "{extra}"]\n')
    with httpx.Client(timeout=10) as c:
        assert c.post(f"{proxy.url}/echo", json={"model": "m"}).status_code == 200
        _assert_403(c.delete(f"{proxy.url}/echo"), "no-default-delete")
    assert load_policy_files([str(base), str(extra)]).default == "allow"
    extra.write_text('default = "deny"\n')
    assert load_policy_files([str(base), str(extra)]).default == "deny"
