"""JWT bearer verification: an RS256 token verified from scratch (header parse, key
lookup, RSA-2048 signature, claims) vs the same token from the verified-token cache.

    python -m pytest bench/bench_jwt.py            (pytest-benchmark groups)
    python bench/bench_jwt.py                      (A/B interleaved, medians and ratio)
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from aiproxy.config import load_config_text
from aiproxy.governance.auth import Authenticator


def _setup(tmp: Path, cache_ttl_s: int) -> tuple[Authenticator, str]:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    jwk.update(kid="k1", alg="RS256")
    (tmp / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    cfg = load_config_text(f"""[[listeners]]
name = "a"
address = "127.0.0.1:1"

[auth.jwt]
jwks_file = "{tmp / 'jwks.json'}"
algorithms = ["RS256"]
audience = "aiproxy"
cache_ttl_s = {cache_ttl_s}
""", str(tmp / "cfg.toml"))
    now = int(time.time())
    token = jwt.encode({"sub": "alice", "aud": "aiproxy", "exp": now + 3600, "iat": now,
                        "roles": ["user"]}, private, algorithm="RS256", headers={"kid": "k1"})
    auth = Authenticator(cfg.auth)
    auth.verify_jwt(token)
    return auth, token


@pytest.mark.parametrize("mode", ["cold", "cached"])
def test_rs256_verify(benchmark, tmp_path, mode: str) -> None:
    benchmark.group = "jwt verify (RS256)"
    auth, token = _setup(tmp_path, 0 if mode == "cold" else 300)
    assert benchmark(auth.verify_jwt, token).subject == "alice"


def main(rounds: int = 21, n: int = 2000) -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "a").mkdir()
        (Path(d) / "b").mkdir()
        cold, token_c = _setup(Path(d) / "a", 0)
        cached, token_h = _setup(Path(d) / "b", 300)
        out: dict[str, list[float]] = {"cold": [], "cached": []}
        for _ in range(rounds):  # A/B interleaved: both see the same machine noise
            for name, auth, token in (("cold", cold, token_c), ("cached", cached, token_h)):
                t0 = time.perf_counter()
                for _ in range(n):
                    auth.verify_jwt(token)
                out[name].append((time.perf_counter() - t0) / n * 1e6)
        med = {k: statistics.median(v) for k, v in out.items()}
        print(f"RS256 verify, median of {rounds} rounds x {n}: cold {med['cold']:.1f} us, "
              f"cached {med['cached']:.2f} us, ratio {med['cold'] / med['cached']:.0f}x")


if __name__ == "__main__":
    main()
