"""The filter chain's features, in request order (responses pass them in reverse).

Order matters: tracing first (every answer, even a refusal, belongs to a trace), then
who is asking, whether they may, what they send, how much they may, and the cache
nearest the upstream (so a cached answer still passes every filter in front of it).
"""

from __future__ import annotations

from aiproxy.governance import audit, auth, policy, tracing
from aiproxy.pipeline.filters import BuilderEntry

BUILDERS: list[BuilderEntry] = [
    ("tracing", tracing.make_state, tracing.build),
    ("audit", audit.make_state, audit.build),
    ("auth", auth.make_state, auth.build),
    ("policy", policy.make_state, policy.build),
]
