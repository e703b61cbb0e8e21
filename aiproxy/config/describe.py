"""Plain-text summary of a loaded configuration, as printed by ``aiproxy check``."""

from __future__ import annotations

from .schema import ClusterConfig, Config, RouteConfig, RouteMatch


def summary(cfg: Config) -> str:
    lines = [
        f"listener {listener.name} {listener.address} [{', '.join(listener.protocols)}]"
        + (f" -> {listener.cluster}" if listener.cluster else "")
        for listener in cfg.listeners
    ]
    if cfg.admin is not None:
        lines.append(f"admin {cfg.admin.address}")
    lines.extend(_cluster(cluster) for cluster in cfg.clusters)
    lines.extend(
        f"route {route.name} {_match(route.match)} -> {_target(route)}" for route in cfg.routes
    )
    return "\n".join(lines)


def _target(route: RouteConfig) -> str:
    if route.split:
        return "split " + ", ".join(f"{t.cluster}={t.weight}" for t in route.split)
    if route.redirect is not None:
        return f"redirect {route.redirect.status}"
    if route.direct_response is not None:
        return f"direct_response {route.direct_response.status}"
    return route.cluster or "?"


def _cluster(cluster: ClusterConfig) -> str:
    endpoints = ", ".join(
        endpoint.address if endpoint.weight == 1 else f"{endpoint.address} weight={endpoint.weight}"
        for endpoint in cluster.endpoints
    )
    return f"cluster {cluster.name} [{endpoints}] {cluster.balancer}"


def _match(match: RouteMatch) -> str:
    parts = []
    if match.path is not None:
        parts.append(f"path={_text(match.path)}")
    if match.path_prefix is not None:
        parts.append(f"path_prefix={_text(match.path_prefix)}")
    if match.method:
        parts.append("method=" + ",".join(_text(method) for method in match.method))
    if match.path_regex is not None:
        parts.append(f"path_regex={_text(match.path_regex)}")
    if match.host is not None:
        parts.append(f"host={_text(match.host)}")
    parts.extend(f"header:{_text(name)}={_text(value)}" for name, value in match.headers)
    parts.extend(f"header:{_text(name)}~{kind}" + (f"={_text(value)}" if value else "")
                 for name, kind, value in match.header_rules)
    parts.extend(f"query:{_text(name)}" + (f"={_text(value)}" if value is not None else "")
                 for name, value in match.query)
    if match.grpc_service is not None:
        parts.append(f"grpc_service={_text(match.grpc_service)}")
    if match.grpc_method is not None:
        parts.append(f"grpc_method={_text(match.grpc_method)}")
    if match.intent is not None:
        parts.append(f"intent={match.intent}")
    if match.intent_domain is not None:
        parts.append(f"intent_domain={match.intent_domain}")
    return " ".join(parts) or "*"


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")
