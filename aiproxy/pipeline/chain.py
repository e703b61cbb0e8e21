"""The filter chain's features, in request order (responses pass them in reverse).

Order matters: tracing first (every answer, even a refusal, belongs to a trace), then
the audit record (it sees every answer, refusals included), who is asking, whether they
may, what they send, how much they may, and the cache nearest the upstream (so a cached
answer still passes every filter in front of it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from aiproxy.cache import prompt
from aiproxy.governance import tracing
from aiproxy.llm import accounting
from aiproxy.pipeline.filters import BuilderEntry
from aiproxy.ratelimit import limiter


def _lazy(name: str, used: Callable[[Any], bool]) -> BuilderEntry:
    """A feature whose module (and its libraries: pyjwt, cryptography ...) is imported
    only by configs that use it."""
    module = f"aiproxy.governance.{name}"

    def make_state(config: Any, previous: Any) -> Any:
        if not used(config) and previous is None:
            return None
        return importlib.import_module(module).make_state(config, previous)

    def build(config: Any, route: Any, state: Any) -> Any:
        return importlib.import_module(module).build(config, route, state)

    return name, make_state, build


BUILDERS: list[BuilderEntry] = [
    ("tracing", tracing.make_state, tracing.build),
    _lazy("audit", lambda c: c.audit is not None),
    _lazy("auth", lambda c: c.auth is not None),
    _lazy("policy", lambda c: c.policy is not None),
    _lazy("guard", lambda c: c.guard is not None or c.redact is not None),
    ("llm", accounting.make_state, accounting.build),
    ("ratelimit", limiter.make_state, limiter.build),
    ("cache", prompt.make_state, prompt.build),
]

# The features that also see an exchange no route took (a 404, a 400 for a bad target,
# a 417): the trace it belongs to and its audit record. Their builders get route None.
UNROUTED = ("tracing", "audit")
# The features a route answered by the proxy (direct_response, redirect) runs.
ANSWERED = ("tracing", "audit", "auth", "policy", "ratelimit")
