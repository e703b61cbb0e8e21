"""ex.llm: what the LLM accounting filter read of one OpenAI-style or Anthropic Messages
exchange."""

from __future__ import annotations

from collections import deque
from math import sqrt
from typing import Any

BULK_STDDEV = 0.002  # s: the last 5 inter-token gaps varying less than this = "bulk"
PATTERN_GAPS = 5


class LlmFacts:
    """One OpenAI-style or Anthropic Messages request and its response, as the accounting
    filter read them.

    endpoint            "chat" | "completions" | "embeddings" | "responses" | "messages"
    tenant              who is charged: the auth identity's subject, else the configured
                        tenant header's value, else the client IP
    model               the request's `model` (None if absent)
    stream              the request asked for an event stream
    max_tokens          max_tokens / max_completion_tokens / max_output_tokens, or None
    prompt_tokens       the upstream's usage.prompt_tokens (Anthropic: input_tokens plus
                        cache_creation_ and cache_read_input_tokens), else the estimate
    completion_tokens   usage.completion_tokens, else the estimate of the text so far
    prompt_estimated    prompt_tokens is an estimate (aiproxy/llm/estimate.py)
    completion_estimated  likewise for completion_tokens
    usage_reported      the upstream sent a `usage` object
    request_truncated   the body was longer than [llm].inspect_bytes: model/stream were
                        read from its start and the prompt estimated from its length
    ttft                seconds from the request's arrival to the first generated text
                        (first response byte for non-streamed responses); None before
    tokens_per_s        completion tokens / generation time (first to last token for a
                        stream, upstream send to response end otherwise); None if unknown
    pattern             "bulk" when the stddev of the last 5 inter-token gaps is under
                        2 ms (tokens arrive in bursts, or a non-streamed body), else
                        "streaming"; None until the response ended
    cached              answered from the prompt cache (no upstream tokens used)
    spent               an upstream answered with a 2xx response, or reported usage:
                        only then do the token counts stand for tokens it spent (a
                        refusal, a proxy error, an upstream error response or no
                        response at all spent none; the counts are then the request's
                        estimate, for the access log only)
    """

    __slots__ = ("endpoint", "tenant", "model", "stream", "max_tokens", "prompt_tokens",
                 "completion_tokens", "prompt_estimated", "completion_estimated",
                 "usage_reported", "request_truncated", "ttft", "tokens_per_s", "pattern",
                 "cached", "spent", "t_first_token", "t_last_token", "gaps", "body", "include_usage")

    def __init__(self, endpoint: str, tenant: str) -> None:
        self.endpoint = endpoint
        self.tenant = tenant
        self.model: str | None = None
        self.stream = False
        self.max_tokens: int | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prompt_estimated = True
        self.completion_estimated = True
        self.usage_reported = False
        self.request_truncated = False
        self.ttft: float | None = None
        self.tokens_per_s: float | None = None
        self.pattern: str | None = None
        self.cached = False
        self.spent = False
        self.t_first_token = 0.0
        self.t_last_token = 0.0
        self.gaps: deque[float] = deque(maxlen=PATTERN_GAPS)
        self.body: dict[str, Any] | None = None  # the parsed request (for the cache key)
        self.include_usage = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def spent_tokens(self) -> int:
        """Tokens an upstream spent on this request (0 for a cache hit, a refusal, an
        error response without usage or no response)."""
        return self.total_tokens if self.spent and not self.cached else 0

    def token_events(self, n: int, now: float) -> None:
        """n events carrying generated text arrived at `now` (one read)."""
        if not self.t_first_token:
            self.t_first_token = now
        else:
            self.gaps.append(now - self.t_last_token)
        self.gaps.extend([0.0] * (n - 1))
        self.t_last_token = now

    def classify_pattern(self) -> str:
        gaps = self.gaps
        if len(gaps) < 2:
            return "bulk"
        mean = sum(gaps) / len(gaps)
        sd = sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
        return "bulk" if sd < BULK_STDDEV else "streaming"

    def log_fields(self) -> dict[str, Any]:
        """The access log's `llm` object."""
        return {
            "endpoint": self.endpoint, "tenant": self.tenant, "model": self.model,
            "stream": self.stream, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "estimated": self.prompt_estimated or self.completion_estimated,
            "ttft_ms": round(self.ttft * 1000, 3) if self.ttft is not None else None,
            "tokens_per_s": round(self.tokens_per_s, 1) if self.tokens_per_s else None,
            "pattern": self.pattern, "cached": self.cached,
        }
