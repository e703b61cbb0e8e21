"""The LLM accounting filter: reads OpenAI-style and Anthropic Messages requests and
responses into ex.llm,
counts tokens per tenant/route/model for /metrics and feeds the llm_score balancer."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from aiproxy._fast.histogram import Histogram
from aiproxy.llm.estimate import tokens_of_bytes
from aiproxy.llm.facts import LlmFacts
from aiproxy.llm.openai import ApiPaths, JsonReader, SseReader, read_request
from aiproxy.pipeline.filters import Filter, FilterFactory
from aiproxy.telemetry.metrics import BUCKETS

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.config.schema import LlmConfig
    from aiproxy.pipeline.exchange import Exchange

OTHER = "other"  # the label of tenants/models past the cardinality bound
TPS_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0)


HEADER_TENANT = "header:"  # how a claimed tenant is kept apart from authenticated ones


def tenant_of(ex: Exchange, header: bytes | None, apart: bool = False) -> str:
    """Who a request is charged to: the authenticated subject, else the configured
    header's value, else the client address. `apart` (the config authenticates): the
    header's value is only a claim, so it is named HEADER_TENANT + value; "alice" in
    the header never shares alice's cache entries, budgets or counters."""
    identity = ex.identity
    if identity is not None:
        return identity.subject
    if header is not None:
        value = ex.head.get(header)
        if value:
            value = value[:128].decode("latin-1")
            return HEADER_TENANT + value if apart else value
    return ex.down.peer.decode()


class Labels:
    """Maps values to metric labels, at most `limit` distinct ones (then "other"), so a
    client cannot grow /metrics without bound by sending new tenants or model names."""

    __slots__ = ("limit", "seen")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if value is None:
            return ""
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return OTHER


class LlmState:
    """Counters kept across reloads. Keys: (tenant, route, model, pattern)."""

    def __init__(self, cfg: LlmConfig) -> None:
        self.configure(cfg)
        self.tenants = Labels(cfg.max_tenants)
        self.models = Labels(cfg.max_models)
        # [requests, prompt tokens, completion tokens, estimated requests, cached requests]
        self.counts: dict[tuple[str, str, str, str], list[int]] = {}
        self.ttft: dict[tuple[str, str], Histogram] = {}
        self.tps: dict[tuple[str, str], Histogram] = {}
        self.factory = LlmFactory(self)

    def configure(self, cfg: LlmConfig) -> None:
        self.cfg = cfg
        self.paths = ApiPaths(cfg.api_prefixes)
        self.header = cfg.tenant_header
        self.apart = False  # make_state: whether the config authenticates (tenant_of)
        self.routes: set[str] | None = None

    def record(self, ex: Exchange, f: LlmFacts) -> None:
        route = ex.route.name
        model = self.models(f.model)
        key = (self.tenants(f.tenant), route, model, f.pattern or "")
        row = self.counts.get(key)
        if row is None:
            row = self.counts[key] = [0, 0, 0, 0, 0]
        row[0] += 1
        if f.cached:  # answered from the cache: no upstream tokens, no model timing
            row[4] += 1
            return
        if not f.spent:  # refused, failed or an upstream error: no upstream tokens
            return
        row[1] += f.prompt_tokens
        row[2] += f.completion_tokens
        if f.prompt_estimated or f.completion_estimated:
            row[3] += 1
        if f.ttft is not None:
            h = self.ttft.get((route, model))
            if h is None:
                h = self.ttft[(route, model)] = Histogram(BUCKETS)
            h.observe(f.ttft)
        if f.tokens_per_s:
            t = self.tps.get((route, model))
            if t is None:
                t = self.tps[(route, model)] = Histogram(TPS_BUCKETS)
            t.observe(f.tokens_per_s)

    def collect(self) -> Iterator[Any]:
        labels = ["tenant", "route", "model", "pattern"]
        fams = [CounterMetricFamily(name, text, labels=labels) for name, text in (
            ("aiproxy_llm_requests", "OpenAI-style and Anthropic Messages requests by "
             "tenant, route, model, pattern"),
            ("aiproxy_llm_prompt_tokens", "Prompt tokens (upstream usage, else estimated)"),
            ("aiproxy_llm_completion_tokens", "Completion tokens (usage, else estimated)"),
            ("aiproxy_llm_estimated_requests", "Requests whose token counts are estimates"),
            ("aiproxy_llm_cached_requests", "Requests answered from the cache (no tokens "
             "counted)"))]
        for key, row in sorted(self.counts.items()):
            for fam, value in zip(fams, row, strict=True):
                fam.add_metric(list(key), value)
        yield from fams
        ttft = HistogramMetricFamily("aiproxy_llm_time_to_first_token_seconds",
                                     "Request arrival to first generated text",
                                     labels=["route", "model"])
        for key, h in sorted(self.ttft.items()):
            ttft.add_metric(list(key), h.cumulative(), h.sum)
        yield ttft
        tps = HistogramMetricFamily("aiproxy_llm_tokens_per_second",
                                    "Completion tokens per second of generation",
                                    labels=["route", "model"])
        for key, t in sorted(self.tps.items()):
            tps.add_metric(list(key), t.cumulative(), t.sum)
        yield tps


class LlmFilter(Filter):
    __slots__ = ("state", "facts", "reader", "finished")

    def __init__(self, state: LlmState, facts: LlmFacts) -> None:
        self.state = state
        self.facts = facts
        self.reader: SseReader | JsonReader | None = None
        self.finished = False

    def request(self, ex: Exchange) -> None:
        f = self.facts
        body = ex.request_body()
        info = read_request(f.endpoint, body, ex.request_body_whole(body),
                            ex.head.content_length)
        if info.model is not None:
            f.model = info.model
        f.stream = info.stream
        f.max_tokens = info.max_tokens
        f.prompt_tokens = info.prompt_tokens
        f.request_truncated = info.truncated
        f.body = info.body
        f.include_usage = info.include_usage
        return None

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        if 200 <= resp.status < 300:
            self.facts.spent = True
            ctype = resp.get(b"content-type") or b""
            self.reader = (SseReader() if ctype[:17].lower() == b"text/event-stream"
                           else JsonReader())
        return resp

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        reader = self.reader
        if reader is not None:
            if type(reader) is SseReader:
                n = reader.feed(data)
                if n:
                    f = self.facts
                    f.token_events(n, perf_counter())
                    f.completion_tokens = tokens_of_bytes(reader.text_bytes)
            else:
                reader.feed(data)
        return data

    def response_end(self, ex: Exchange) -> bytes:
        self._settle(ex)
        return b""

    def _settle(self, ex: Exchange) -> None:
        if self.finished:
            return
        self.finished = True
        f = self.facts
        reader = self.reader
        usage = None
        text_bytes = 0
        if type(reader) is SseReader:
            usage, text_bytes = reader.usage, reader.text_bytes
        elif reader is not None:
            usage, text_bytes = reader.result()
        if usage is not None:
            f.spent = True
            f.prompt_tokens, f.completion_tokens = usage
            f.prompt_estimated = f.completion_estimated = False
            f.usage_reported = True
        else:
            f.completion_tokens = tokens_of_bytes(text_bytes)
            if type(reader) is SseReader and reader.prompt is not None:
                # A Messages stream that ended before message_delta: its input is known.
                f.prompt_tokens = reader.prompt
                f.prompt_estimated = False
                f.usage_reported = True
        end = perf_counter()
        if type(reader) is SseReader:
            if f.t_first_token:
                f.ttft = f.t_first_token - ex.t_start_pc
                span = f.t_last_token - f.t_first_token
                if span > 0 and f.completion_tokens:
                    f.tokens_per_s = f.completion_tokens / span
            f.pattern = f.classify_pattern()
        elif reader is not None:
            if ex.t_first:
                f.ttft = ex.t_first - ex.t_start_pc
            start = ex.t_sent or ex.t_first
            if start and end > start and f.completion_tokens:
                f.tokens_per_s = f.completion_tokens / (end - start)
            f.pattern = "bulk"

    def done(self, ex: Exchange) -> None:
        self._settle(ex)
        f = self.facts
        if ex.route is not None:
            self.state.record(ex, f)
        pool = ex.pool
        if pool is not None and ex.cluster.track_tokens and f.spent_tokens:
            pool.stats.add_tokens(f.spent_tokens, ex.loop.time())


class LlmFactory(FilterFactory):
    name = "llm"

    def __init__(self, state: LlmState) -> None:
        self.state = state

    @property
    def inspect_bytes(self) -> int:  # type: ignore[override]
        return self.state.cfg.inspect_bytes

    def start(self, ex: Exchange) -> Filter | None:
        if ex.method != b"POST":
            return None
        state = self.state
        found = state.paths.lookup(ex.path)
        if found is None:
            # A route that serves the upstream's /v1/ under another prefix (/openai/v1/
            # with prefix_rewrite = "/") carries the same API: read the path sent on.
            route = ex.route
            if route.prefix_rewrite is None:
                return None
            found = state.paths.lookup(route.prefix_rewrite + ex.path[len(route.path_prefix):])
            if found is None:
                return None
        facts = LlmFacts(found[0], tenant_of(ex, state.header, state.apart))
        # Azure's deployment (a `*` segment) names the model a body without "model" uses.
        facts.model = found[1]
        ex.llm = facts
        return LlmFilter(state, facts)


def llm_config(config: Config) -> LlmConfig | None:
    """The accounting config: [llm], or its defaults when a feature needs accounting."""
    from aiproxy.config.schema import LlmConfig

    if config.llm is not None:
        return config.llm
    if config.ratelimits or config.cache is not None:
        return LlmConfig()
    return None


def accounted_routes(config: Config) -> set[str] | None:
    """Routes the accounting runs on (None: all): [llm]'s, plus every route a rate
    limit or the cache applies to (they read ex.llm)."""
    selections = [r.routes for r in config.ratelimits]
    if config.llm is not None:
        selections.append(config.llm.routes)
    if config.cache is not None:
        selections.append(config.cache.routes)
    if any(not s for s in selections):
        return None
    return {name for s in selections for name in s}


def make_state(config: Config, previous: LlmState | None) -> LlmState | None:
    cfg = llm_config(config)
    if cfg is None:
        return None
    state = previous if previous is not None else LlmState(cfg)
    state.configure(cfg)
    state.apart = config.auth is not None
    state.routes = accounted_routes(config)
    return state


def build(config: Config, route: RouteConfig, state: LlmState) -> FilterFactory | None:
    routes = state.routes
    if routes is not None and route.name not in routes:
        return None
    return state.factory
