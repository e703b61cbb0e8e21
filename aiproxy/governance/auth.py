"""`[auth]`: who is asking. API keys (salted hashes), JWT bearer tokens and mTLS client
certificates establish ex.identity; a request without valid credentials gets 401 with
WWW-Authenticate (RFC 6750 3) when auth is required (when it is not, also when the policy
denies it and credentials could lift that: policy.identity_could_allow).

JWT: the token's `alg` must be on the configured allow-list (so `none` never passes),
and the key is chosen by `kid` from a JWKS file and must be of the algorithm's family
(an HS256 token is never checked against an RSA key's bytes: key confusion). The JWKS
file is re-read when it changes; a broken file keeps the previous keys. Verified
tokens are cached (aiproxy/governance/token_cache.py; cleared when the JWKS changes,
kept across a config reload that leaves the JWT settings and keys as they were).

The credential is removed before the request goes upstream. With upstream_identity the
upstream gets x-aiproxy-identity (subject, kind, roles, time) and its HMAC-SHA256 in
x-aiproxy-identity-signature; fields of those names from the client are always dropped.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

import jwt

from aiproxy.config.errors import ConfigError
from aiproxy.config.governance import ApiKey, AuthConfig, JwtConfig, load_key_file
from aiproxy.governance.token_cache import TokenCache
from aiproxy.governance.watch import FileWatch
from aiproxy.pipeline.filters import Filter, FilterFactory, Identity, LocalReply

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.auth")

IDENTITY_HEADER = b"x-aiproxy-identity"
SIGNATURE_HEADER = b"x-aiproxy-identity-signature"
BEARER_CHALLENGE = "bearer_challenge"  # ex.gov key: the request's credential was a bearer token
# ex.gov key: the request carried no credentials where auth would have taken some
AUTH_CHALLENGE = "auth_challenge"
KEY_FAMILIES = {"HS": "oct", "RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
NOT_IN_DESCRIPTION = re.compile(r"[^\x20\x21\x23-\x5b\x5d-\x7e]")  # RFC 6750 3
DESCRIPTION_MAX = 256
VERIFIED_CACHE = 4096  # presented API key digests known good (unsalted, in memory only)


def hash_key(key: str, salt: bytes | None = None) -> str:
    """The stored form of an API key: sha256$SALT$HEX. API keys are long random
    strings, so one salted SHA-256 is enough (no password stretching needed)."""
    salt = os.urandom(16) if salt is None else salt
    return f"sha256${salt.hex()}${hashlib.sha256(salt + key.encode()).hexdigest()}"


def new_key() -> str:
    return "ak_" + base64.urlsafe_b64encode(os.urandom(30)).decode().rstrip("=")


class AuthError(Exception):
    def __init__(self, error: str | None, description: str) -> None:
        super().__init__(description)
        self.error = error  # RFC 6750 error code: invalid_request | invalid_token | None


class KeyStore:
    """API keys from the config plus the key file (re-read when it changes)."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.inline = cfg.api_keys
        self.file = cfg.key_file
        self.keys: tuple[ApiKey, ...] = cfg.api_keys
        self.watch = FileWatch([cfg.key_file]) if cfg.key_file else None
        self.verified: dict[bytes, ApiKey] = {}
        if cfg.key_file:
            self._load()

    def _load(self) -> None:
        try:
            self.keys = self.inline + load_key_file(self.file)
        except ConfigError as exc:
            log.error("API key file not reloaded, the previous keys stay:\n%s", exc)
            return
        self.verified.clear()

    def find(self, presented: str) -> ApiKey | None:
        if self.watch is not None and self.watch.changed():
            self._load()
        raw = presented.encode()
        fast = hashlib.sha256(raw).digest()
        key = self.verified.get(fast)
        if key is not None:
            return key
        found = None
        for key in self.keys:
            if hmac.compare_digest(hashlib.sha256(key.salt + raw).digest(), key.digest):
                found = key
        if found is not None:
            if len(self.verified) >= VERIFIED_CACHE:
                self.verified.clear()
            self.verified[fast] = found
        return found


def read_jwks(path: str) -> tuple[dict[str | None, jwt.PyJWK], bytes, list[str]]:
    """The signature keys of a JWKS file by kid, the file's digest, and why keys were
    skipped (encryption keys among them: `use` other than "sig", or `key_ops` without
    "verify", RFC 7517 4.2/4.3). OSError or ValueError when the file cannot be read or is
    not a JWKS."""
    with open(path, "rb") as fh:
        raw = fh.read()
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError('not a JWKS (expected {"keys": [...]})')
    keys = {}
    skipped = []
    for item in data["keys"]:
        if isinstance(item, dict) and (
                item.get("use", "sig") != "sig"
                or ("key_ops" in item and not (isinstance(item["key_ops"], list)
                                               and "verify" in item["key_ops"]))):
            skipped.append(f"key {item.get('kid')} skipped: not a signature key "
                           f"(use {item.get('use')!r}, key_ops {item.get('key_ops')!r})")
            continue
        try:
            k = jwt.PyJWK(item)
        except (jwt.PyJWKError, jwt.InvalidKeyError, TypeError, AttributeError,
                ValueError) as exc:
            kid = item.get("kid") if isinstance(item, dict) else None
            skipped.append(f"key {kid} skipped: {exc}")
            continue
        # RFC 7517 4.4: a key that names its alg is for that alg only (PyJWK fills in a
        # default for one that does not, so keep what the file said).
        k.stated_alg = item.get("alg")
        keys[k.key_id] = k
    return keys, hashlib.sha256(raw).digest(), skipped


class Jwks:
    """Verification keys by kid from a JWKS file, re-read on change."""

    def __init__(self, cfg: JwtConfig) -> None:
        self.cfg = cfg
        self.watch = FileWatch([cfg.jwks_file])
        self.keys: dict[str | None, jwt.PyJWK] = {}
        self.digest = b""  # of the JWKS file the keys came from
        self.load()

    def load(self) -> bool:
        try:
            keys, digest, skipped = read_jwks(self.cfg.jwks_file)
        except (OSError, ValueError) as exc:
            log.error("JWKS %s not loaded, the previous keys stay: %s", self.cfg.jwks_file, exc)
            return False
        for why in skipped:
            log.warning("JWKS %s: %s", self.cfg.jwks_file, why)
        self.keys = keys
        self.digest = digest
        return True

    def refresh(self) -> bool:
        """Re-read the file if it changed; True when the keys were replaced."""
        return self.watch.changed() and self.load()

    def key_for(self, kid: str | None, alg: str) -> jwt.PyJWK:
        key = self.keys.get(kid)
        if key is None and kid is None and len(self.keys) == 1:
            key = next(iter(self.keys.values()))
        if key is None:
            raise AuthError("invalid_token", "unknown signing key")
        if key.key_type != KEY_FAMILIES.get(alg[:2]) or key.stated_alg not in (None, alg):
            raise AuthError("invalid_token", "signing key does not fit the token's algorithm")
        return key


class Authenticator:
    def __init__(self, cfg: AuthConfig, previous: Authenticator | None = None) -> None:
        """`previous`: the authenticator of the config this one replaces, whose verified
        tokens carry over when they would verify the same way under this one."""
        self.cfg = cfg
        self.keys = KeyStore(cfg) if cfg.api_keys or cfg.key_file else None
        self.jwks = Jwks(cfg.jwt) if cfg.jwt is not None else None
        self.tokens = (TokenCache(cfg.jwt.cache_size, cfg.jwt.cache_ttl_s)
                       if cfg.jwt is not None and cfg.jwt.cache_size and cfg.jwt.cache_ttl_s
                       else None)
        if self.tokens is not None and previous is not None and previous.tokens is not None:
            self.tokens.adopt(previous.tokens, entries=self._same_jwt(previous))
        challenge = f'Bearer realm="{cfg.realm}"'
        self.challenge = challenge.encode()

    def _same_jwt(self, old: Authenticator) -> bool:
        """Would a token verified by `old` give the same answer here: same keys (the
        JWKS as read now), algorithms, issuer, audiences, leeway, required and identity
        claims, and a cache lifetime no longer than before?"""
        new, was = self.cfg.jwt, old.cfg.jwt
        if was is None or old.jwks.digest != self.jwks.digest:
            return False
        return (dataclasses.replace(was, cache_size=new.cache_size,
                                    cache_ttl_s=new.cache_ttl_s) == new
                and new.cache_ttl_s >= was.cache_ttl_s)

    def verify_jwt(self, token: str) -> Identity:
        """The token's identity (AuthError if refused), from the cache when it was
        verified before and the keys have not changed since."""
        cache = self.tokens
        if self.jwks.refresh() and cache is not None:
            cache.clear()
        if cache is None:
            return self._verify_jwt(token)
        now = time.time()
        hit = cache.get(token, now)
        if hit is not None:
            if isinstance(hit, Identity):
                return hit  # shared by the requests presenting this token; never mutated
            raise AuthError(*hit)  # a fresh exception: a re-raised one grows its traceback
        try:
            identity = self._verify_jwt(token)
        except AuthError as exc:
            cache.refused(token, (exc.error, str(exc)), now)
            raise
        cache.verified(token, identity, identity.claims.get("exp"), now)
        return identity

    def _verify_jwt(self, token: str) -> Identity:
        cfg = self.cfg.jwt
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as exc:
            raise AuthError("invalid_token", f"malformed token: {exc}") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in cfg.algorithms:
            raise AuthError("invalid_token", f"algorithm {alg!r} is not allowed")
        kid = header.get("kid")
        key = self.jwks.key_for(kid if isinstance(kid, str) else None, alg)
        try:
            # With no audience configured, a token that names one is refused: the proxy
            # is not among its audiences (RFC 7519 4.1.3 MUST).
            claims = jwt.decode(
                token, key.key, algorithms=[alg], audience=list(cfg.audience) or None,
                issuer=cfg.issuer, leeway=cfg.leeway_s, options={"require": list(cfg.require)})
        except jwt.ExpiredSignatureError:
            raise AuthError("invalid_token", "token expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthError("invalid_token", "token not yet valid") from None
        except jwt.InvalidAudienceError:
            raise AuthError("invalid_token", "wrong audience") from None
        except jwt.InvalidIssuerError:
            raise AuthError("invalid_token", "wrong issuer") from None
        except jwt.InvalidTokenError as exc:
            raise AuthError("invalid_token", f"invalid token: {exc}") from None
        for name in ("exp", "nbf", "iat"):
            value = claims.get(name)
            if name in claims and (isinstance(value, bool) or not isinstance(value, int | float)):
                # RFC 7519 2: a JSON number (pyjwt also takes "123" and true, by int()).
                raise AuthError("invalid_token", f"{name} is not a NumericDate")
        subject = claims.get(cfg.subject_claim)
        if not isinstance(subject, str) or not subject:
            raise AuthError("invalid_token", f"no {cfg.subject_claim} claim")
        roles = claims.get(cfg.roles_claim, ())
        if isinstance(roles, str):
            roles = roles.split()
        roles = tuple(r for r in roles if isinstance(r, str)) if isinstance(roles, list | tuple) \
            else ()
        return Identity(subject, "jwt", claims, roles)

    def authenticate(self, ex: Exchange) -> Identity | None:
        """The request's identity; None when it carries no credentials; AuthError when
        it carries bad ones."""
        head = ex.head
        header = self.cfg.api_key_header
        presented = head.get(header)
        if presented is not None:
            ex.set_upstream_header(header, None)  # never upstream, whichever was used
            if len(head.get_all(header)) > 1:
                raise AuthError("invalid_request", "more than one API key")
        authz = head.get(b"authorization")
        if authz is not None and len(head.get_all(b"authorization")) > 1:
            # Which one counts would be a guess (and a second one a way to smuggle one).
            raise AuthError("invalid_request", "more than one Authorization field")
        if authz is not None:
            scheme, _, value = authz.partition(b" ")
            if scheme.split(b"\t", 1)[0].lower() != b"bearer":
                # RFC 6750 3.1: another scheme (or none) is no usable credential, so the
                # challenge has no error code; it is refused, not passed on upstream.
                raise AuthError(None, "expected Authorization: Bearer")
            if len(scheme) != 6 or not value.strip():  # "Bearer<TAB>...", or no token
                raise AuthError("invalid_request", "expected Authorization: Bearer")
            ex.set_upstream_header(b"authorization", None)
            token = value.strip().decode("latin-1")
            if self.jwks is not None and token.count(".") == 2:
                if "=" in token:
                    # RFC 7515 2: base64url without padding. Decoders that take padding
                    # would give one token many spellings (and cache entries).
                    raise AuthError("invalid_token", "malformed token (padding)")
                identity = self.verify_jwt(token)
            else:
                identity = self._api_key(token)
            # A policy denial of a bearer token answers with this challenge (RFC 6750 3.1
            # insufficient_scope); other credentials get no Bearer challenge.
            ex.gov[BEARER_CHALLENGE] = self.challenge
            return identity
        if presented is not None:
            return self._api_key(presented.strip().decode("latin-1"))
        if self.cfg.mtls:
            return self._client_cert(ex)
        return None

    def _api_key(self, presented: str) -> Identity:
        if self.keys is None:
            raise AuthError("invalid_token", "API keys are not accepted here")
        key = self.keys.find(presented)
        if key is None:
            raise AuthError("invalid_token", "unknown API key")
        return Identity(key.subject, "api_key", {"key_id": key.id}, key.roles)

    def _client_cert(self, ex: Exchange) -> Identity | None:
        cert = peer_certificate(ex.down)
        if not cert:
            return None
        subject = dict(x[0] for x in cert.get("subject", ()))
        cn = subject.get("commonName")
        if not cn:
            raise AuthError("invalid_token", "client certificate without a common name")
        claims = {"subject": subject,
                  "issuer": dict(x[0] for x in cert.get("issuer", ())),
                  "san": [v for _, v in cert.get("subjectAltName", ())],
                  "serial": cert.get("serialNumber")}
        return Identity(cn, "mtls", claims, self.cfg.mtls_roles)

    def sign(self, identity: Identity, now: int) -> tuple[bytes, bytes]:
        """(x-aiproxy-identity, its signature) for the upstream."""
        value = "subject={};kind={};roles={};ts={}".format(
            _quote(identity.subject), identity.kind,
            ",".join(_quote(r) for r in identity.roles), now).encode()
        return value, hmac.new(self.cfg.upstream_secret, value, hashlib.sha256).hexdigest().encode()


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def peer_certificate(down: Any) -> dict | None:
    """The verified client certificate of the connection under a downstream (an
    HTTP/1.1 connection or an HTTP/2 stream), or None."""
    conn = getattr(down, "conn", down)
    transport = getattr(conn, "transport", None)
    if transport is None:
        return None
    sslobj = transport.get_extra_info("ssl_object")
    if sslobj is None:
        return None
    try:
        return sslobj.getpeercert()
    except ValueError:
        return None


class AuthFactory(FilterFactory):
    name = "auth"

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def metric_families(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = self.auth.tokens
        if cache is None:
            return
        yield CounterMetricFamily("aiproxy_jwt_cache_hits", "JWTs answered from the cache",
                                  value=cache.hits)
        yield CounterMetricFamily("aiproxy_jwt_cache_misses",
                                  "JWTs verified (not in the cache, or expired there)",
                                  value=cache.misses)
        yield GaugeMetricFamily("aiproxy_jwt_cache_entries", "JWTs in the cache",
                                value=len(cache.entries))

    def start(self, ex: Exchange) -> Filter | None:
        auth = self.auth
        ex.set_upstream_header(IDENTITY_HEADER, None)
        ex.set_upstream_header(SIGNATURE_HEADER, None)
        try:
            identity = auth.authenticate(ex)
        except AuthError as exc:
            return _Refuse(auth, exc.error, str(exc))
        if identity is None:
            if auth.cfg.required:
                return _Refuse(auth, None, "credentials required")
            # For the policy: a denial that credentials could lift is then a 401.
            ex.gov[AUTH_CHALLENGE] = auth.challenge
            return None
        ex.identity = identity
        if auth.cfg.upstream_secret is not None:
            value, sig = auth.sign(identity, int(time.time()))
            ex.set_upstream_header(IDENTITY_HEADER, value)
            ex.set_upstream_header(SIGNATURE_HEADER, sig)
        return None


class _Refuse(Filter):
    """Answers 401 (400 for invalid_request, RFC 6750 3.1) when the chain reaches auth (filters before it, tracing and audit,
    still see the refusal)."""

    __slots__ = ("reply",)

    def __init__(self, auth: Authenticator, error: str | None, description: str) -> None:
        challenge = auth.challenge
        if error is not None:
            # The description can quote the token (pyjwt names an unknown crit extension
            # as sent): only RFC 6750 3's characters, never a CR LF that splits the head.
            text = NOT_IN_DESCRIPTION.sub("?", description.replace('"', "'"))
            challenge += b', error="%s", error_description="%s"' % (
                error.encode(), text[:DESCRIPTION_MAX].encode())
        status = 400 if error == "invalid_request" else 401
        self.reply = LocalReply(status, "unauthorized", description,
                                [(b"www-authenticate", challenge)])

    def request(self, ex: Exchange) -> LocalReply:
        return self.reply


def make_state(config: Config, previous: Any) -> Any:
    if config.auth is None:
        return None
    old = previous.auth if isinstance(previous, AuthFactory) else None
    return AuthFactory(Authenticator(config.auth, old))


def build(config: Config, route: RouteConfig, state: AuthFactory) -> FilterFactory:
    return state
