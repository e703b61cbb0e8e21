"""Settings a config may hold that turn off a safety check: each a warning naming its
file, line and key, from `aiproxy check`, at start and on a reload (nginx and Envoy
accept them silently; a forgotten one should not stay unnoticed)."""

from __future__ import annotations

from .address import loopback_name
from .errors import Problem
from .loader import read_config_text
from .locate import Locator, format_path
from .schema import Config


def insecure_settings(config: Config) -> list[Problem]:
    found: list[tuple[tuple, str]] = []
    for index, cluster in enumerate(config.clusters):
        if cluster.tls is not None and not cluster.tls.verify:
            found.append((("clusters", index, "tls", "verify"),
                          f"cluster '{cluster.name}' does not check its endpoints' TLS "
                          "certificates or host names: anyone on the path can answer "
                          "for them"))
    admin = config.admin
    if admin is not None and not admin.token and not loopback_name(admin.host):
        found.append((("admin", "address"),
                      f"the admin API on '{admin.address}' is off loopback and has no token: "
                      "anyone who reaches it can read /config and POST /config/reload "
                      "(set [admin] token, or keep it on loopback)"))
    if not found:
        return []
    try:
        locator: Locator | None = Locator(read_config_text(config.source))
    except Exception:  # noqa: BLE001 - a config given as text: no lines to name
        locator = None
    return [Problem(config.source, locator.line(path) if locator else 0, format_path(path),
                    message) for path, message in found]
