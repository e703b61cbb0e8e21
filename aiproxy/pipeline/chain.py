"""The filter chain's features, in request order (responses pass them in reverse).

Order matters: tracing first (every answer, even a refusal, belongs to a trace), then
who is asking, whether they may, what they send, how much they may, and the cache
nearest the upstream (so a cached answer still passes every filter in front of it).
"""

from __future__ import annotations

from aiproxy.cache import prompt
from aiproxy.governance import tracing
from aiproxy.llm import accounting
from aiproxy.pipeline.filters import BuilderEntry
from aiproxy.ratelimit import limiter

BUILDERS: list[BuilderEntry] = [
    ("tracing", tracing.make_state, tracing.build),
    # audit, auth, policy, guard go here (governance)
    ("llm", accounting.make_state, accounting.build),
    ("ratelimit", limiter.make_state, limiter.build),
    ("cache", prompt.make_state, prompt.build),
]
