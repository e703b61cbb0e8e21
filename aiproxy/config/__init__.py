"""Configuration: TOML file -> validated, immutable :class:`Config`."""

from .address import format_address, parse_address
from .describe import summary
from .errors import ConfigError, Problem
from .loader import BALANCERS, PROTOCOLS, load_config, load_config_text, read_config_text
from .schema import (
    AccessLogConfig,
    AdminConfig,
    ClusterConfig,
    Config,
    Endpoint,
    HttpConfig,
    ListenerConfig,
    RouteConfig,
    RouteMatch,
    SemanticConfig,
    ServerConfig,
    TlsConfig,
    TracingConfig,
    UpstreamTlsConfig,
)

__all__ = [
    "AccessLogConfig",
    "BALANCERS",
    "PROTOCOLS",
    "AdminConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "Endpoint",
    "HttpConfig",
    "ListenerConfig",
    "Problem",
    "RouteConfig",
    "RouteMatch",
    "SemanticConfig",
    "ServerConfig",
    "TlsConfig",
    "TracingConfig",
    "UpstreamTlsConfig",
    "format_address",
    "load_config",
    "load_config_text",
    "parse_address",
    "read_config_text",
    "summary",
]
