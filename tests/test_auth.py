"""[auth] through a running proxy: API keys, JWT (RS256/ES256/HS256 from a JWKS file,
rotation, and the attacks an allow-list must stop), mTLS subjects, 401 replies, and the
signed identity the upstream sees."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from aiproxy.config import ConfigError, load_config_text
from aiproxy.governance.auth import hash_key
from tests.conftest import simple_config
from tests.h2_support import make_pki
from tests.support import admin_block, free_port, scrape, wait_port

KEY = "ak_test_key_0123456789abcdef"
SECRET = "upstream-signing-secret-0123456789"


def _rsa():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _jwk(private, kid: str) -> dict:
    alg = "RS256" if isinstance(private, rsa.RSAPrivateKey) else "ES256"
    cls = jwt.algorithms.RSAAlgorithm if alg == "RS256" else jwt.algorithms.ECAlgorithm
    d = json.loads(cls.to_jwk(private.public_key()))
    d.update(kid=kid, use="sig", alg=alg)
    return d


@pytest.fixture(scope="module")
def keys():
    return {"rsa1": _rsa(), "rsa2": _rsa(), "ec1": ec.generate_private_key(ec.SECP256R1())}


def _write_jwks(path: Path, keys: dict, kids: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": [_jwk(keys[k], k) for k in kids]}))
    tmp.replace(path)


def _token(private, kid: str, alg: str = "RS256", **claims) -> str:
    now = int(time.time())
    body = {"sub": "alice", "aud": "aiproxy", "iss": "https://issuer.test", "exp": now + 300,
            "iat": now, "roles": ["user"]}
    body.update(claims)
    return jwt.encode({k: v for k, v in body.items() if v is not None}, private,
                      algorithm=alg, headers={"kid": kid})


def _auth_config(upstream: int, jwks: Path, extra: str = "") -> str:
    return simple_config(upstream) + f"""
[tracing]

[auth]
realm = "test"

[[auth.api_keys]]
id = "k1"
subject = "svc-batch"
hash = "{hash_key(KEY)}"
roles = ["batch"]

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256", "ES256"]
issuer = "https://issuer.test"
audience = "aiproxy"
leeway_s = 30

[auth.upstream_identity]
secret = "{SECRET}"
{extra}
"""


@pytest.fixture
def jwt_proxy(start_proxy, demo_upstream, tmp_path, keys):
    jwks = tmp_path / "jwks.json"
    _write_jwks(jwks, keys, ["rsa1", "ec1"])
    # One worker: the JWKS is re-read lazily by each process when a request reaches it, so
    # with several workers one that saw no request while a good file stood would skip it.
    proxy = start_proxy("[server]\nworkers = 1\n" + _auth_config(demo_upstream, jwks))
    proxy.jwks = jwks
    return proxy


def _get(proxy, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{proxy.url}/echo", headers=headers, timeout=10)


def _assert_401(r: httpx.Response, needle: str) -> None:
    assert r.status_code == 401, r.text
    challenge = r.headers["www-authenticate"]
    assert challenge.startswith('Bearer realm="test"'), challenge
    assert r.json()["error"]["code"] == "unauthorized"
    assert needle in r.json()["error"]["message"], r.text


def test_api_key_good_and_bad_and_stripped(jwt_proxy):
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        r = _get(jwt_proxy, headers)
        assert r.status_code == 200, r.text
        seen = r.json()["headers"]
        assert "x-api-key" not in seen and "authorization" not in seen  # not sent upstream
        value = seen["x-aiproxy-identity"]
        assert "subject=svc-batch;kind=api_key;roles=batch;" in value
        sig = hmac.new(SECRET.encode(), value.encode(), hashlib.sha256).hexdigest()
        assert seen["x-aiproxy-identity-signature"] == sig
    _assert_401(_get(jwt_proxy, {"x-api-key": KEY + "x"}), "unknown API key")
    r = _get(jwt_proxy, {})
    _assert_401(r, "credentials required")
    assert "error=" not in r.headers["www-authenticate"]  # RFC 6750 3.1: no error w/o creds
    # A client cannot pass an identity of its own to the upstream.
    r = _get(jwt_proxy, {"x-api-key": KEY, "x-aiproxy-identity": "subject=root",
                         "x-aiproxy-identity-signature": "00"})
    assert "subject=svc-batch" in r.json()["headers"]["x-aiproxy-identity"]
    # Nor any other x-aiproxy-* field the proxy states (or x_aiproxy_*, the same name to
    # a CGI-style server), and the API key header is stripped even when a Bearer
    # credential was the one used.
    r = _get(jwt_proxy, {"authorization": f"Bearer {KEY}", "x-api-key": "other-key",
                         "x-aiproxy-guard-flags": "none", "x-aiproxy-policy-rule": "allow",
                         "x_aiproxy_identity": "subject=root"})
    seen = r.json()["headers"]
    assert r.status_code == 200 and "subject=svc-batch" in seen["x-aiproxy-identity"]
    assert not {"x-api-key", "x-aiproxy-guard-flags", "x-aiproxy-policy-rule",
                "x_aiproxy_identity"} & set(seen), seen
    # Two credentials of a kind: which one counts would be a guess.
    for name, value in (("x-api-key", KEY), ("authorization", f"Bearer {KEY}")):
        r = httpx.get(f"{jwt_proxy.url}/echo", timeout=10,
                      headers=[(name, value), (name, value + "x")])
        # RFC 6750 3.1: invalid_request is a 400.
        assert r.status_code == 400 and "more than one" in r.json()["error"]["message"], r.text


def test_jwt_accepted_rs256_and_es256(jwt_proxy, keys):
    for kid, alg in (("rsa1", "RS256"), ("ec1", "ES256")):
        r = _get(jwt_proxy, {"authorization": f"Bearer {_token(keys[kid], kid, alg)}"})
        assert r.status_code == 200, r.text
        seen = r.json()["headers"]
        assert "authorization" not in seen
        assert "subject=alice;kind=jwt;roles=user;" in seen["x-aiproxy-identity"]


def test_jwt_refusals(jwt_proxy, keys):
    now = int(time.time())
    rsa1 = keys["rsa1"]
    public_pem = rsa1.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    unsigned = jwt.api_jws.base64url_encode(json.dumps(
        {"alg": "none", "kid": "rsa1"}).encode()).decode() + "." + \
        jwt.api_jws.base64url_encode(json.dumps(
            {"sub": "alice", "aud": "aiproxy", "iss": "https://issuer.test",
             "exp": now + 300}).encode()).decode() + "."
    # HS256 "signed" with the RSA public key's PEM: the classic key-confusion forgery.
    import hmac as _hmac
    header = jwt.api_jws.base64url_encode(json.dumps({"alg": "HS256", "kid": "rsa1",
                                                      "typ": "JWT"}).encode())
    payload = jwt.api_jws.base64url_encode(json.dumps(
        {"sub": "mallory", "aud": "aiproxy", "iss": "https://issuer.test",
         "exp": now + 300}).encode())
    signing = header + b"." + payload
    forged = (signing + b"." + jwt.api_jws.base64url_encode(
        _hmac.new(public_pem, signing, hashlib.sha256).digest())).decode()
    cases = {
        "token expired": _token(rsa1, "rsa1", exp=now - 120),
        "token not yet valid": _token(rsa1, "rsa1", nbf=now + 120),
        "wrong audience": _token(rsa1, "rsa1", aud="someone-else"),
        "wrong issuer": _token(rsa1, "rsa1", iss="https://evil.test"),
        "algorithm 'none' is not allowed": unsigned,
        "algorithm 'HS256' is not allowed": forged,
        "unknown signing key": _token(keys["rsa2"], "rsa2"),
        "Signature verification failed": _token(keys["rsa2"], "rsa1"),
        "no sub claim": _token(rsa1, "rsa1", sub=None),
        'missing the "exp" claim': _token(rsa1, "rsa1", exp=None),
        # A valid token with base64 padding appended: another spelling of the same one.
        "malformed token (padding)": _token(rsa1, "rsa1") + "==",
    }
    for needle, token in cases.items():
        r = _get(jwt_proxy, {"authorization": f"Bearer {token}"})
        _assert_401(r, needle)
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
    # Within the configured leeway (30 s) an expired token still passes.
    token = _token(rsa1, "rsa1", exp=int(time.time()) - 5)
    r = _get(jwt_proxy, {"authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    _assert_401(_get(jwt_proxy, {"authorization": "Basic YTpi"}), "expected Authorization")


def test_hs256_allow_list_refuses_rsa_keys(start_proxy, demo_upstream, tmp_path, keys):
    """With only HS256 allowed, a token naming an RSA key id is refused by key family
    before any HMAC runs with the RSA key's bytes."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [
        _jwk(keys["rsa1"], "rsa1"),
        {"kty": "oct", "kid": "hs", "k": jwt.api_jws.base64url_encode(b"s" * 32).decode()}]}))
    text = simple_config(demo_upstream) + f"""
[auth]
[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["HS256"]
"""
    proxy = start_proxy(text)
    good = jwt.encode({"sub": "bob", "exp": int(time.time()) + 60}, b"s" * 32, "HS256",
                      headers={"kid": "hs"})
    assert _get(proxy, {"authorization": f"Bearer {good}"}).status_code == 200
    pem = keys["rsa1"].public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    header = jwt.api_jws.base64url_encode(b'{"alg":"HS256","kid":"rsa1"}')
    payload = jwt.api_jws.base64url_encode(
        json.dumps({"sub": "mallory", "exp": int(time.time()) + 60}).encode())
    sig = jwt.api_jws.base64url_encode(
        hmac.new(pem, header + b"." + payload, hashlib.sha256).digest())
    forged = (header + b"." + payload + b"." + sig).decode()
    r = _get(proxy, {"authorization": f"Bearer {forged}"})
    assert r.status_code == 401
    assert "does not fit" in r.json()["error"]["message"]


def test_jwks_rotation(jwt_proxy, keys):
    new_token = _token(keys["rsa2"], "rsa2")
    old_token = _token(keys["rsa1"], "rsa1")
    assert _get(jwt_proxy, {"authorization": f"Bearer {new_token}"}).status_code == 401
    _write_jwks(jwt_proxy.jwks, keys, ["rsa2"])
    deadline = time.monotonic() + 5
    while _get(jwt_proxy, {"authorization": f"Bearer {new_token}"}).status_code != 200:
        assert time.monotonic() < deadline, "rotated key never accepted"
        time.sleep(0.05)
    _assert_401(_get(jwt_proxy, {"authorization": f"Bearer {old_token}"}),
                "unknown signing key")
    # A broken JWKS file keeps the keys that work.
    jwt_proxy.jwks.write_text("{not json")
    time.sleep(0.6)
    assert _get(jwt_proxy, {"authorization": f"Bearer {new_token}"}).status_code == 200
    assert "JWKS" in jwt_proxy.log() and "previous keys stay" in jwt_proxy.log()


def test_key_file_and_hash_key_cli(start_proxy, demo_upstream, tmp_path):
    out = subprocess.run([sys.executable, "-m", "aiproxy", "auth", "hash-key", "--generate"],
                         capture_output=True, text=True, check=True)
    key = out.stderr.split("key: ", 1)[1].strip()
    stored = out.stdout.strip()
    keyfile = tmp_path / "keys.toml"
    keyfile.write_text(f'[[keys]]\nid = "gen"\nsubject = "carol"\nhash = "{stored}"\n')
    proxy = start_proxy(simple_config(demo_upstream) + f'[auth]\nkey_file = "{keyfile}"\n')
    with httpx.Client() as client:
        r = client.get(f"{proxy.url}/echo", headers={"x-api-key": key})
        assert r.status_code == 200, r.text
        # A key added to the file works without a restart.
        key2 = "ak_second_key_abcdefghijklmnop"
        keyfile.write_text(keyfile.read_text() + f'\n[[keys]]\nid = "two"\nsubject = "dave"\n'
                           f'hash = "{hash_key(key2)}"\n')
        deadline = time.monotonic() + 5
        while client.get(f"{proxy.url}/echo", headers={"x-api-key": key2}).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_config_errors_name_file_and_line(tmp_path):
    jwks = tmp_path / "j.json"
    jwks.write_text('{"keys": []}')
    text = f"""[[listeners]]
name = "a"
address = "127.0.0.1:1"

[auth]
[[auth.api_keys]]
id = "x"
subject = "y"
hash = "plain-text-key"

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["HS256", "RS256", "none"]
"""
    with pytest.raises(ConfigError) as err:
        load_config_text(text, "cfg.toml")
    msg = str(err.value)
    assert "cfg.toml:9: auth.api_keys[0].hash: expected sha256$SALT$HEX" in msg, msg
    assert "cfg.toml:13: auth.jwt.algorithms[2]: unknown value 'none'" in msg, msg
    assert "HS* cannot be mixed" in msg


def test_grpc_unauthenticated_over_h2c(start_proxy, demo_upstream, tmp_path, keys):
    import grpc

    jwks = tmp_path / "jwks.json"
    _write_jwks(jwks, keys, ["rsa1"])
    proxy = start_proxy(_auth_config(demo_upstream, jwks), 'protocols = ["http1", "h2c"]')
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        call = channel.unary_unary("/pkg.Svc/Method")
        with pytest.raises(grpc.RpcError) as err:
            call(b"payload", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "credentials required"
        with pytest.raises(grpc.RpcError) as err:
            call(b"payload", timeout=10, metadata=[("x-api-key", "wrong")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A malformed credential is 400 over HTTP (RFC 6750 3.1), which gRPC's status
        # mapping makes INTERNAL; to a gRPC caller it is still UNAUTHENTICATED.
        with pytest.raises(grpc.RpcError) as err:
            call(b"payload", timeout=10, metadata=[("authorization", "Bearer")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_mtls_subject_is_the_identity(start_proxy, demo_upstream, tmp_path):
    pki = make_pki(tmp_path / "pki")
    listener = (f'protocols = ["http1", "h2"]\ntls = {{ cert = "{pki.cert}", key = "{pki.key}", '
                f'ca = "{pki.ca}" }}')
    proxy = start_proxy(simple_config(demo_upstream) + f"""
[auth]
mtls = {{ roles = ["service"] }}
upstream_identity = {{ secret = "{SECRET}" }}
""", listener)
    for flag in ("--http1.1", "--http2"):
        res = subprocess.run(
            ["curl", "-s", flag, "--cacert", str(pki.ca), "--cert", str(pki.client_cert),
             "--key", str(pki.client_key), f"https://127.0.0.1:{proxy.port}/echo"],
            capture_output=True, timeout=10, check=True)
        seen = json.loads(res.stdout)["headers"]
        assert seen["x-aiproxy-identity"].startswith("subject=client;kind=mtls;roles=service;")


def _authenticator(tmp_path: Path, keys: dict, extra: str = ""):
    from aiproxy.governance.auth import Authenticator

    jwks = tmp_path / "jwks.json"
    _write_jwks(jwks, keys, ["rsa1"])
    cfg = load_config_text(f"""[[listeners]]
name = "a"
address = "127.0.0.1:1"

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256"]
audience = "aiproxy"
leeway_s = 0
{extra}
""", str(tmp_path / "cfg.toml"))
    return Authenticator(cfg.auth), jwks


def _refused(auth, token: str) -> str:
    from aiproxy.governance.auth import AuthError

    with pytest.raises(AuthError) as err:
        auth.verify_jwt(token)
    return str(err.value)


def test_jwt_cache_hit_expiry_and_jwks_change(tmp_path, keys):
    """Real RS256 tokens and JWKS file: a verified token is served from the cache, but
    never past its exp, and not after the JWKS changed."""
    auth, jwks = _authenticator(tmp_path, keys)
    token = _token(keys["rsa1"], "rsa1")
    first = auth.verify_jwt(token)
    assert auth.verify_jwt(token) is first and auth.tokens.hits == 1
    assert first.subject == "alice" and first.roles == ("user",)

    short = _token(keys["rsa1"], "rsa1", exp=int(time.time()) + 3)  # slack for a loaded box
    assert auth.verify_jwt(short).subject == "alice"
    exp = jwt.decode(short, options={"verify_signature": False})["exp"]
    while time.time() <= exp:
        time.sleep(0.05)
    assert "token expired" in _refused(auth, short)

    _write_jwks(jwks, keys, ["rsa2"])  # rsa1 withdrawn: its cached tokens go too
    time.sleep(0.3)  # the JWKS file is checked at most every 0.25 s
    assert "unknown signing key" in _refused(auth, token)


def test_jwt_cache_keeps_refusals_briefly(tmp_path, keys):
    auth, _ = _authenticator(tmp_path, keys)
    nbf = int(time.time()) + 2
    early = _token(keys["rsa1"], "rsa1", nbf=nbf)
    assert "not yet valid" in _refused(auth, early)
    misses = auth.tokens.misses
    assert "not yet valid" in _refused(auth, early)  # from the cache
    assert auth.tokens.misses == misses and auth.tokens.hits == 1
    while time.time() <= nbf:
        time.sleep(0.05)
    assert auth.verify_jwt(early).subject == "alice"  # refusal held <= 1 s


def test_jwt_cache_bounded_and_off(tmp_path, keys):
    auth, _ = _authenticator(tmp_path, keys, "cache_size = 2")
    tokens = [_token(keys["rsa1"], "rsa1", jti=str(i)) for i in range(3)]
    for t in tokens:
        auth.verify_jwt(t)
    assert list(auth.tokens.entries) == tokens[1:]  # least recently used went first
    auth.verify_jwt(tokens[1])
    auth.verify_jwt(_token(keys["rsa1"], "rsa1", jti="x"))
    assert tokens[1] in auth.tokens.entries and tokens[2] not in auth.tokens.entries
    off, _ = _authenticator(tmp_path, keys, "cache_ttl_s = 0")
    assert off.tokens is None and off.verify_jwt(tokens[0]).subject == "alice"
    with pytest.raises(ConfigError) as err:
        _authenticator(tmp_path, keys, "cache_size = -1")
    assert "cfg.toml:10: auth.jwt.cache_size: must be between 0 and 1000000" in str(err.value)


def test_jwt_cache_survives_reloads_that_keep_the_jwt_settings(start_proxy, demo_upstream,
                                                              tmp_path, keys):
    """A reload (POST /config/reload or SIGHUP) that leaves [auth.jwt] and the JWKS as they
    were keeps the verified tokens (the next request is a cache hit); one that changes
    them (here the leeway) starts from an empty cache."""
    jwks = tmp_path / "jwks.json"
    _write_jwks(jwks, keys, ["rsa1"])
    admin = free_port()
    base = "[server]\nworkers = 1\n" + _auth_config(demo_upstream, jwks) + admin_block(admin)
    proxy = start_proxy(base)
    base = proxy.config_path.read_text()  # with the listener
    wait_port("127.0.0.1", admin)
    token = {"authorization": f"Bearer {_token(keys['rsa1'], 'rsa1')}"}

    def jwt_cache() -> tuple[float, float, float]:
        s = scrape(admin)
        return (s[("aiproxy_jwt_cache_hits_total", ())],
                s[("aiproxy_jwt_cache_misses_total", ())], s[("aiproxy_jwt_cache_entries", ())])

    def reload(text: str, how: str) -> None:
        before = scrape(admin)[("aiproxy_config_reloads_total", ())]
        proxy.config_path.write_text(text)
        if how == "http":
            r = httpx.post(f"http://127.0.0.1:{admin}/config/reload", timeout=10)
            assert r.status_code == 200, r.text
        else:
            proxy.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while scrape(admin)[("aiproxy_config_reloads_total", ())] == before:
            assert time.monotonic() < deadline, "reload did not happen"
            time.sleep(0.05)

    assert _get(proxy, token).status_code == 200
    assert _get(proxy, token).status_code == 200
    assert jwt_cache() == (1, 1, 1)
    # Other sections change, the JWT settings do not: the entry stays.
    reload(base.replace('realm = "test"', 'realm = "test2"'), "http")
    assert jwt_cache() == (1, 1, 1)
    assert _get(proxy, token).status_code == 200
    assert jwt_cache() == (2, 1, 1)
    reload(base + '\n[[routes]]\nname = "extra"\nmatch = { path_prefix = "/x" }\n'
                  'cluster = "up"\n', "sighup")
    assert _get(proxy, token).status_code == 200
    assert jwt_cache() == (3, 1, 1)
    # The leeway changes: tokens are verified afresh.
    reload(base.replace("leeway_s = 30", "leeway_s = 5"), "http")
    assert jwt_cache()[2] == 0
    assert _get(proxy, token).status_code == 200
    assert jwt_cache() == (3, 2, 1)
    # The JWKS file changes while the config is reloaded: dropped too.
    _write_jwks(jwks, keys, ["rsa1", "ec1"])
    reload(base.replace("leeway_s = 30", "leeway_s = 5") + "\n", "sighup")
    assert jwt_cache()[2] == 0
