"""Attacks on [auth] through a running proxy with real tokens (pyjwt, cryptography) and a
real upstream: forged JOSE headers, claim types, JWKS key use, token transport, RFC 6750
challenges, and where the credential must never turn up. (tests/test_auth.py has the
basics: allow-list, key confusion, exp/nbf/aud/iss, rotation, duplicate fields.)"""

from __future__ import annotations

import base64
import json
import signal
import socket
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import get_default_algorithms

from aiproxy.governance.auth import hash_key
from tests.conftest import simple_config
from tests.support import admin_block, free_port, scrape, wait_port

KEY = "ak_attack_key_0123456789abcdef"
ISS = "https://issuer.test"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwk(private, kid: str, **extra) -> dict:
    cls = (jwt.algorithms.RSAAlgorithm if isinstance(private, rsa.RSAPrivateKey)
           else jwt.algorithms.ECAlgorithm)
    d = json.loads(cls.to_jwk(private.public_key()))
    d.update(kid=kid, **extra)
    return d


def _sign(private, header: dict | bytes, payload: dict | bytes, alg: str = "RS256") -> str:
    """A token with exactly these header and payload bytes (pyjwt's encode would refuse
    or normalise some of what an attacker sends)."""
    h = _b64(header if isinstance(header, bytes) else json.dumps(header).encode())
    p = _b64(payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    algo = get_default_algorithms()[alg]
    return f"{h}.{p}.{_b64(algo.sign(f'{h}.{p}'.encode(), private))}"


def _claims(**over) -> dict:
    now = int(time.time())
    body = {"sub": "alice", "aud": "aiproxy", "iss": ISS, "exp": now + 300, "iat": now}
    body.update(over)
    return {k: v for k, v in body.items() if v is not None}


@pytest.fixture(scope="module")
def keys():
    gen = lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048)  # noqa: E731
    return {"rsa1": gen(), "enc": gen(), "ops": gen(), "rs512": gen(), "other": gen(),
            "ec1": ec.generate_private_key(ec.SECP256R1())}


@pytest.fixture
def proxy(start_proxy, demo_upstream, tmp_path, keys):
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [
        _jwk(keys["rsa1"], "rsa1", use="sig", alg="RS256"),
        _jwk(keys["ec1"], "ec1"),
        _jwk(keys["enc"], "enc", use="enc"),                # an encryption key
        _jwk(keys["ops"], "ops", key_ops=["encrypt"]),      # ditto, by key_ops
        _jwk(keys["rs512"], "rs512", alg="RS512")]}))        # for RS512 only
    keyfile = tmp_path / "keys.toml"
    keyfile.write_text(f'[[keys]]\nid = "k1"\nsubject = "batch"\nhash = "{hash_key(KEY)}"\n')
    admin = free_port()
    p = start_proxy("[server]\nworkers = 1\n" + simple_config(demo_upstream) + f"""
[access_log]
path = "{tmp_path / 'access.log'}"

[audit]
path = "{tmp_path / 'audit.log'}"

[auth]
realm = "test"
key_file = "{keyfile}"

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256", "RS512", "ES256"]
issuer = "{ISS}"
audience = "aiproxy"
leeway_s = 30
""" + admin_block(admin))
    wait_port("127.0.0.1", admin)
    p.admin, p.keyfile, p.dir = admin, keyfile, tmp_path
    return p


def _get(proxy, headers, path: str = "/echo") -> httpx.Response:
    return httpx.get(f"{proxy.url}{path}", headers=headers, timeout=10)


def _bearer(proxy, token: str) -> httpx.Response:
    return _get(proxy, {"authorization": f"Bearer {token}"})


def _invalid_token(r: httpx.Response) -> str:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith('Bearer realm="test", error="invalid_token"')
    return r.json()["error"]["message"]


def test_forged_jose_headers_are_refused(proxy, keys):
    """alg none in any spelling, unknown crit extensions (RFC 7515 4.1.11), keys the token
    brings along (jwk, jku, x5u) and kid strings meant for a file path or a query."""
    rsa1, other = keys["rsa1"], keys["other"]
    none = _b64(b'{"alg":"none","kid":"rsa1"}') + "." + _b64(json.dumps(_claims()).encode()) + "."
    cases = [none.replace("none", alg) for alg in ("none", "None", "NONE")]
    cases.append(_sign(rsa1, {"alg": "RS256", "kid": "rsa1", "crit": ["x-ext"], "x-ext": 1},
                       _claims()))
    own = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(other.public_key()))
    for extra in ({"jwk": own}, {"jwk": own, "kid": "rsa1"},
                  {"jku": "http://127.0.0.1:9/jwks.json", "kid": "rsa1"},
                  {"x5u": "http://127.0.0.1:9/cert.pem", "kid": "rsa1"}):
        cases.append(_sign(other, {"alg": "RS256", **extra}, _claims()))
    for kid in ("../../../../dev/null", "' OR '1'='1", "rsa1\x00", "rsa1/../rsa1"):
        cases.append(_sign(rsa1, {"alg": "RS256", "kid": kid}, _claims()))
    # Duplicate header names: the last one counts (RFC 7515 4), for the check and the verify.
    cases.append(_sign(rsa1, b'{"alg":"RS256","kid":"rsa1","alg":"none"}', _claims()))
    # Deeply nested JSON is a refusal, not a RecursionError.
    cases.append(_b64(b'{"alg":"RS256","x":' + b"[" * 5000 + b"]" * 5000 + b"}") + ".e30.AA")
    for token in cases:
        _invalid_token(_bearer(proxy, token))
    assert _bearer(proxy, _sign(rsa1, {"alg": "RS256", "kid": "rsa1"}, _claims())).status_code \
        == 200


def test_numeric_dates_must_be_json_numbers(proxy, keys):
    """RFC 7519 2/4.1.4: exp, nbf and iat are JSON numbers. A string or a boolean is not
    one (pyjwt alone reads "exp": "9999999999" with int() and nbf true as 1)."""
    rsa1 = keys["rsa1"]
    head = {"alg": "RS256", "kid": "rsa1"}
    later = int(time.time()) + 300
    for over in ({"exp": str(later)}, {"exp": f" {later} "}, {"nbf": True}, {"iat": "0"},
                 {"exp": later, "nbf": False}):
        msg = _invalid_token(_bearer(proxy, _sign(rsa1, head, _claims(**over))))
        assert "NumericDate" in msg, msg
    # Numbers of any size are fine: a float, and an exp past float range (which the
    # token cache must not choke on: that was a 500 and an escaped exception).
    for exp in (later + 0.5, 10**400):
        assert _bearer(proxy, _sign(rsa1, head, _claims(exp=exp))).status_code == 200
        assert _bearer(proxy, _sign(rsa1, head, _claims(exp=exp))).status_code == 200  # cached
    assert "filter auth failed" not in proxy.log()


def test_long_refused_tokens_do_not_fill_the_cache(proxy):
    """Refusals are cached briefly, but not for tokens near the header limit: otherwise
    cache_size of them (10000 x 30 KiB) stay in memory at an unauthenticated client's word."""
    def entries() -> float:
        return scrape(proxy.admin)[("aiproxy_jwt_cache_entries", ())]

    short = "eyJhbGciOiJSUzI1NiJ9.e30.AA"
    _invalid_token(_bearer(proxy, short))
    assert entries() == 1  # a short one is kept
    with httpx.Client() as client:
        for i in range(20):
            junk = "eyJhbGciOiJSUzI1NiJ9." + f"{i:04d}" + "A" * 30000 + ".AA"
            r = client.get(f"{proxy.url}/echo", headers={"authorization": f"Bearer {junk}"})
            _invalid_token(r)
    assert entries() == 1


def test_jwks_keys_for_encryption_or_other_algorithms_do_not_verify(proxy, keys):
    """RFC 7517 4.2-4.4: a key with use "enc", or key_ops without "verify", is not a
    signature key; a key that states its alg verifies only that alg."""
    for kid in ("enc", "ops"):
        token = _sign(keys[kid], {"alg": "RS256", "kid": kid}, _claims())
        assert _invalid_token(_bearer(proxy, token)) == "unknown signing key"
    token = _sign(keys["rs512"], {"alg": "RS256", "kid": "rs512"}, _claims())
    assert "does not fit" in _invalid_token(_bearer(proxy, token))
    token = _sign(keys["rs512"], {"alg": "RS512", "kid": "rs512"}, _claims(), "RS512")
    assert _bearer(proxy, token).status_code == 200
    # A key that states nothing serves its family (ec1: ES256).
    token = _sign(keys["ec1"], {"alg": "ES256", "kid": "ec1"}, _claims(), "ES256")
    assert _bearer(proxy, token).status_code == 200
    assert "key enc skipped" in proxy.log() and "key ops skipped" in proxy.log()


def _raw(proxy, head_lines: list[bytes]) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                  + b"".join(line + b"\r\n" for line in head_lines) + b"\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0]
    return int(head.split(b" ", 2)[1]), head.lower()


def test_transport_and_rfc6750_challenges(proxy, keys):
    good = _sign(keys["rsa1"], {"alg": "RS256", "kid": "rsa1"}, _claims())
    # The auth-scheme is case-insensitive (RFC 9110 11.1); spaces around the token are OWS.
    for line in (b"Authorization: bearer " + good.encode(), b"authorization: BEARER   "
                 + good.encode() + b"  ", b"x-api-key:   " + KEY.encode() + b" \t"):
        status, _ = _raw(proxy, [line])
        assert status == 200, line
    # Another scheme is no usable credential: 401 with a challenge and no error code
    # (RFC 6750 3.1), and the Basic credentials are not passed on.
    r = _get(proxy, {"authorization": "Basic YWxpY2U6cHc="})
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="test"'
    # A malformed request is invalid_request with 400 (RFC 6750 3.1).
    for headers in ([("authorization", "Bearer")], [("authorization", f"Bearer\t{good}")],
                    [("authorization", f"Bearer {good}"), ("authorization", f"Bearer {good}")],
                    [("x-api-key", KEY), ("x-api-key", KEY)]):
        r = _get(proxy, headers)
        assert r.status_code == 400, (headers, r.text)
        assert 'error="invalid_request"' in r.headers["www-authenticate"]
        assert r.json()["error"]["code"] == "unauthorized"
    # A token in the query string is not a credential (RFC 6750 2.3 is not offered).
    r = _get(proxy, {}, f"/echo?access_token={good}")
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="test"'
    # Past max_header_bytes: 431 before any token work.
    status, _ = _raw(proxy, [b"authorization: Bearer " + b"a" * 40000 + b".b.c"])
    assert status == 431


def test_credentials_never_reach_upstream_or_logs(proxy, keys):
    token = _sign(keys["rsa1"], {"alg": "RS256", "kid": "rsa1"}, _claims())
    bad = _sign(keys["other"], {"alg": "RS256", "kid": "rsa1"}, _claims())
    for headers in ({"authorization": f"Bearer {token}"}, {"x-api-key": KEY},
                    {"authorization": f"Bearer {KEY}"}):
        r = _get(proxy, headers)
        assert r.status_code == 200
        assert not {"authorization", "x-api-key"} & set(r.json()["headers"])
    _invalid_token(_bearer(proxy, bad))
    _invalid_token(_get(proxy, {"x-api-key": KEY + "x"}))
    deadline = time.monotonic() + 10
    audit = proxy.dir / "audit.log"
    while not audit.exists() or audit.read_text().count("\n") < 5:
        assert time.monotonic() < deadline, "audit records not written"
        time.sleep(0.05)
    texts = [audit.read_text(), proxy.log()]
    access = proxy.dir / "access.log"
    while not access.exists() or access.read_text().count("\n") < 5:
        assert time.monotonic() < deadline, "access log not written"
        time.sleep(0.05)
    texts.append(access.read_text())
    for text in texts:
        for secret in (token, bad, KEY, token.split(".")[2], bad.split(".")[2]):
            assert secret not in text


def test_revoked_api_key_stops_after_sighup(proxy):
    """A key file edited in place to the same size (which a stat may not tell apart) is
    read again on SIGHUP: the revoked key is refused from then on."""
    assert _get(proxy, {"x-api-key": KEY}).status_code == 200
    other = "ak_attack_key_0123456789abcdeX"
    text = proxy.keyfile.read_text()
    new = text.replace(text.split('hash = "')[1].split('"')[0], hash_key(other))
    assert len(new) == len(text)
    with open(proxy.keyfile, "r+") as fh:  # same inode, same size
        fh.write(new)
    before = scrape(proxy.admin)[("aiproxy_config_reloads_total", ())]
    proxy.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while scrape(proxy.admin)[("aiproxy_config_reloads_total", ())] == before:
        assert time.monotonic() < deadline, "no reload"
        time.sleep(0.05)
    r = _get(proxy, {"x-api-key": KEY})
    assert r.status_code == 401 and "unknown API key" in r.text
    assert _get(proxy, {"x-api-key": other}).status_code == 200


def test_token_for_an_audience_is_refused_where_none_is_configured(start_proxy, demo_upstream,
                                                                    tmp_path, keys):
    """RFC 7519 4.1.3: a JWT with an `aud` claim MUST be rejected by a recipient that
    does not identify itself with one of its values. Without `audience` configured the
    proxy identifies with none, so a token minted for another service (any `aud`) is
    refused; a token without `aud` still passes."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [_jwk(keys["rsa1"], "rsa1", use="sig")]}))
    proxy = start_proxy(simple_config(demo_upstream) + f"""
[auth]
realm = "test"

[auth.jwt]
jwks_file = "{jwks}"
algorithms = ["RS256"]
""")
    head = {"alg": "RS256", "kid": "rsa1"}
    assert _bearer(proxy, _sign(keys["rsa1"], head, _claims(aud=None))).status_code == 200
    for aud in ("billing-service", ["billing-service", "other"]):
        msg = _invalid_token(_bearer(proxy, _sign(keys["rsa1"], head, _claims(aud=aud))))
        assert "wrong audience" in msg, msg


def test_error_description_cannot_carry_header_injection(proxy, keys):
    """The refusal's error_description quotes pyjwt's message, which for an unknown
    `crit` extension is the attacker's string as sent: a CR LF in it split the 401's
    head (an injected field, a second response). RFC 6750 3 allows only %x20-21,
    %x23-5B and %x5D-7E there; anything else goes as "?"."""
    ext = 'x\r\nx-evil: 1\r\n\r\nHTTP/1.1 200 OK\r\nback\\slash "q" \u00e9'
    token = _sign(keys["rsa1"], {"alg": "RS256", "kid": "rsa1", "crit": [ext]}, _claims())
    status, head = _raw(proxy, [b"authorization: Bearer " + token.encode()])
    assert status == 401
    fields = head.split(b"\r\n")[1:]
    assert all(b":" in f and not f.startswith(b"http/") for f in fields), fields
    assert not any(f.startswith(b"x-evil") for f in fields), fields
    challenge = next(f for f in fields if f.startswith(b"www-authenticate:"))
    desc = challenge.split(b'error_description="', 1)[1][:-1]
    assert all(c in (0x20, 0x21) or 0x23 <= c <= 0x5B or 0x5D <= c <= 0x7E for c in desc), desc
    assert desc.startswith(b"malformed token: unsupported critical extension: x??x-evil"), desc
