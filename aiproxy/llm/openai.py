"""What an OpenAI-style or Anthropic Messages request asks for and what its response used.

Requests: the JSON body of /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/responses and Anthropic's /v1/messages gives model, stream, the completion limit and
the prompt text; a body longer than the bytes inspected is read with regexes on its
start and its prompt size estimated from its length.

Responses: a JSON body's `usage`, or an SSE stream read event by event as its bytes go
past (nothing is held back): each `data:` event's delta text, `usage` in the final
chunk (stream_options.include_usage), and `[DONE]`. Anthropic's usage counts input
apart from cache reads and writes (input_tokens + cache_creation_input_tokens +
cache_read_input_tokens is the prompt, as OpenAI's prompt_tokens includes its cached
tokens); a Messages stream reports the input in message_start's message.usage and the
output, cumulatively, in message_delta's usage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from aiproxy import wirejson
from aiproxy.llm.estimate import MESSAGE_OVERHEAD, tokens_of_bytes, tokens_of_text

# The endpoints, by what follows an API prefix ([llm] api_prefixes, "/v1/" by default).
ENDPOINTS = {
    b"chat/completions": "chat",
    b"completions": "completions",
    b"embeddings": "embeddings",
    b"responses": "responses",
    b"messages": "messages",  # Anthropic's Messages API
}
DEFAULT_PREFIXES = ("/v1/",)
# Anthropic's usage: input apart from the tokens written to and read from its cache.
CACHE_FIELDS = ("cache_creation_input_tokens", "cache_read_input_tokens")

# A model name is kept to this many characters (it goes to logs and metric labels).
MODEL_CHARS = 200
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,%d})"' % MODEL_CHARS)
# A "model" in a body no strict parser takes (escapes included: decoded as JSON's).
_MODEL_ESCAPED = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_STREAM = re.compile(rb'"stream"\s*:\s*(true|false)')
_MAX = re.compile(rb'"(?:max_tokens|max_completion_tokens|max_output_tokens)"\s*:\s*(\d{1,9})')
_USAGE_FIELD = re.compile(
    rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens|cache_creation_input_tokens'
    rb'|cache_read_input_tokens)"\s*:\s*(\d{1,12})')
# Generated text in a stream chunk: chat delta content, completions text, Responses API
# output_text delta (string values only; "delta":{...} objects do not match).
_TEXT = re.compile(rb'"(?:content|text|delta)"\s*:\s*"((?:[^"\\]|\\.)*)"')
_HAS_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# A Responses API event's type: its text is generated in *.delta events, and the .done
# events (output_text, content_part, output_item) repeat it whole.
_RESPONSES_TYPE = re.compile(rb'"type"\s*:\s*"response\.[^"]*"')
JSON_LIMIT = 1 << 20  # response bytes kept to read a JSON body's usage and text


# (kind, None) per endpoint: what ApiPaths.lookup returns for a prefix without `*`.
_PLAIN = {tail: (kind, None) for tail, kind in ENDPOINTS.items()}
_TAIL = b"(" + b"|".join(re.escape(t) for t in ENDPOINTS) + b")/*"


def _one_prefix(prefix: bytes) -> Callable[[bytes], tuple[str, None] | None]:
    n = len(prefix)
    table = {prefix + tail: found for tail, found in _PLAIN.items()}

    def lookup(path: bytes) -> tuple[str, None] | None:
        return table.get(path.rstrip(b"/")) if path[:n] == prefix else None

    return lookup


class ApiPaths:
    """Where the endpoints are served: [llm] api_prefixes, compiled once per config.
    A `*` in a prefix is one whole path segment (Azure's /openai/deployments/*/).

    lookup(path): (endpoint kind, the segment the last `*` matched or None), or None when
    the path is no endpoint under these prefixes."""

    __slots__ = ("plain", "pattern", "lookup")

    def __init__(self, prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> None:
        self.plain = tuple(p.encode() for p in prefixes if "*" not in p)
        patterns = [re.escape(p.encode()).replace(rb"\*", rb"([^/]+)")
                    for p in prefixes if "*" in p]
        self.pattern = (re.compile(b"(?:" + b"|".join(patterns) + b")" + _TAIL)
                        if patterns else None)
        self.lookup: Callable[[bytes], tuple[str, str | None] | None]
        if self.pattern is None and len(self.plain) == 1:
            self.lookup = _one_prefix(self.plain[0])  # the default: one bytes check
        else:
            self.lookup = self._lookup

    def _lookup(self, path: bytes) -> tuple[str, str | None] | None:
        for prefix in self.plain:
            if path.startswith(prefix):
                found = _PLAIN.get(path[len(prefix):].rstrip(b"/"))
                if found is not None:
                    return found
        pattern = self.pattern
        if pattern is not None:
            m = pattern.fullmatch(path)
            if m is not None:
                groups = [g for g in m.groups() if g is not None]
                # The last group is the endpoint, the one before it the last `*`.
                kind = ENDPOINTS[groups[-1]]
                segment = groups[-2].decode("utf-8", "replace")[:MODEL_CHARS]
                return kind, segment
        return None

    def kind(self, path: bytes) -> str | None:
        """The endpoint kind of a request path ("chat", ...), None for others."""
        found = self.lookup(path)
        return None if found is None else found[0]


DEFAULT_PATHS = ApiPaths()


def endpoint_of(path: bytes) -> str | None:
    """The endpoint kind of a request path under the default /v1/, None for others."""
    return DEFAULT_PATHS.kind(path)


def _text(value: Any, out: list[str]) -> None:
    """Collect the strings of a prompt/content/input value (nested parts included)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _text(item, out)
    elif isinstance(value, dict):
        for key in ("text", "content", "input_text"):
            if key in value:
                _text(value[key], out)


class RequestInfo:
    """What the request body says (see LlmFacts for the meaning of the fields)."""

    __slots__ = ("model", "stream", "max_tokens", "prompt_tokens", "body", "truncated",
                 "include_usage")

    def __init__(self) -> None:
        self.model: str | None = None
        self.stream = False
        self.max_tokens: int | None = None
        self.prompt_tokens = 0
        self.body: dict[str, Any] | None = None  # the parsed JSON object (complete bodies)
        self.truncated = False
        self.include_usage = False


def read_request(kind: str, body: bytes, complete: bool, length: int) -> RequestInfo:
    """Parse a request body; `complete` says whether body is all of it, `length` is its
    Content-Length (-1 if unknown)."""
    info = RequestInfo()
    data = None
    if complete:
        try:
            data = wirejson.loads(body)
        except ValueError:
            data = None
    if not isinstance(data, dict):
        # Too long to inspect whole (or not JSON): what its start says, size estimated.
        info.truncated = not complete
        m = _MODEL.search(body)
        if m is not None:
            info.model = m.group(1).decode("utf-8", "replace")
        m = _STREAM.search(body)
        info.stream = m is not None and m.group(1) == b"true"
        m = _MAX.search(body)
        if m is not None:
            info.max_tokens = int(m.group(1))
        info.prompt_tokens = tokens_of_bytes(max(length, len(body)))
        return info
    info.body = data
    model = model_text(data.get("model"))
    if model is not None:
        info.model = model
    info.stream = data.get("stream") is True
    opts = data.get("stream_options")
    info.include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            info.max_tokens = value
            break
    texts: list[str] = []
    overhead = 0
    if kind == "chat" or kind == "messages":
        if kind == "messages":  # Anthropic: a top-level system (a string or text blocks)
            _text(data.get("system"), texts)
        messages = data.get("messages")
        if isinstance(messages, list):
            overhead = MESSAGE_OVERHEAD * len(messages)
            for m in messages:
                if isinstance(m, dict):
                    _text(m.get("content"), texts)
    elif kind == "completions":
        _text(data.get("prompt"), texts)
    elif kind == "embeddings":
        _text(data.get("input"), texts)
    else:  # responses
        _text(data.get("instructions"), texts)
        _text(data.get("input"), texts)
    info.prompt_tokens = overhead + sum(tokens_of_text(t) for t in texts)
    return info


def _count(value: Any) -> int | None:
    """A token count: a non-negative integer (not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _input_tokens(usage: dict[str, Any]) -> int | None:
    """The prompt of a usage object: prompt_tokens, else input_tokens plus Anthropic's
    cache writes and reads (absent or null: none)."""
    if "prompt_tokens" in usage:
        return _count(usage["prompt_tokens"])
    prompt = _count(usage.get("input_tokens"))
    if prompt is not None:
        for key in CACHE_FIELDS:
            prompt += _count(usage.get(key)) or 0
    return prompt


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an OpenAI `usage` object (chat/completions/
    embeddings: prompt_/completion_tokens; responses: input_/output_tokens) or of an
    Anthropic message's (input_tokens and cache counts, output_tokens)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    kind = obj.get("type")
    if not isinstance(usage, dict) and isinstance(kind, str) and kind.startswith("response."):
        resp = obj.get("response")
        usage = resp.get("usage") if isinstance(resp, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = _input_tokens(usage)
    completion = _count(usage.get("completion_tokens", usage.get("output_tokens", 0)))
    if prompt is None or completion is None:
        return None
    return prompt, completion


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # a JSON \ud800 escape counts too


def completion_text_bytes(obj: Any) -> int:
    """UTF-8 bytes of the generated text in a response object or stream chunk."""
    if not isinstance(obj, dict):
        return 0
    n = 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if not isinstance(c, dict):
                continue
            for part in (c.get("delta"), c.get("message")):
                if isinstance(part, dict):
                    content = part.get("content")
                    if isinstance(content, str):
                        n += _utf8_len(content)
            text = c.get("text")
            if isinstance(text, str):
                n += _utf8_len(text)
    delta = obj.get("delta")  # Responses API: response.output_text.delta
    if isinstance(delta, str):
        n += _utf8_len(delta)
    output = obj.get("output")
    if isinstance(output, list):
        texts: list[str] = []
        _text(output, texts)
        n += sum(map(_utf8_len, texts))
    content = obj.get("content")  # an Anthropic message: its text blocks
    if obj.get("type") == "message" and isinstance(content, list):
        texts = []
        _text(content, texts)
        n += sum(map(_utf8_len, texts))
    return n


class SseReader:
    """Reads an event stream incrementally: feed() each body piece as it passes and
    get the number of text-carrying events it completed; partial lines wait (only the
    incomplete last line is kept). Tracks usage, generated text bytes and [DONE].
    Anthropic's usage comes in parts: `prompt` from message_start (or a message_delta
    that repeats it), the output from message_delta; `usage` is set once both came."""

    __slots__ = ("partial", "cr", "data", "size", "usage", "text_bytes", "done", "events",
                 "prompt", "output")

    def __init__(self) -> None:
        self.partial = b""
        self.cr = False  # the last piece ended in CR: an LF opening the next one is its pair
        self.data: list[bytes] = []
        self.size = 0  # bytes in data; -1: the event outgrew JSON_LIMIT and is skipped
        self.usage: tuple[int, int] | None = None
        self.text_bytes = 0
        self.done = False
        self.events = 0
        self.prompt: int | None = None  # Anthropic: the input reported so far
        self.output: int | None = None  # Anthropic: the cumulative output reported

    def feed(self, chunk: bytes) -> int:
        """Returns how many events carrying generated text ended in this chunk."""
        if self.cr and chunk:
            self.cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self.partial + chunk if self.partial else chunk
        start = 0
        texty = 0
        # A line ends in CRLF, LF or a CR alone (WHATWG event stream: end-of-line).
        has_cr = b"\r" in buf
        while True:
            end = buf.find(b"\n", start)
            if has_cr:
                cr = buf.find(b"\r", start, len(buf) if end < 0 else end)
                if cr >= 0:
                    end = cr
            if end < 0:
                break
            line = buf[start:end]
            start = end + 1
            if buf[end] == 0x0D:
                if start == len(buf):
                    self.cr = True
                elif buf[start] == 0x0A:
                    start += 1
            if not line:
                if self.data:
                    texty += self._event(b"\n".join(self.data))
                    self.data = []
                self.size = 0
            elif line[:5] == b"data:" and self.size >= 0:
                value = line[5:]
                if value[:1] == b" ":
                    value = value[1:]
                self.size += len(value) + 1
                if self.size > JSON_LIMIT:  # data lines without an end: stop collecting
                    self.data, self.size = [], -1
                else:
                    self.data.append(value)
        rest = buf[start:]
        if len(rest) > JSON_LIMIT:  # a line without end: stop collecting it
            rest = b""
        self.partial = rest
        return texty

    def _event(self, data: bytes) -> int:
        self.events += 1
        if data == b"[DONE]":
            self.done = True
            return 0
        m = _RESPONSES_TYPE.search(data) if b'"response.' in data else None
        repeats = m is not None and not m.group().endswith(b'.delta"')
        if _HAS_USAGE.search(data) is None:
            if repeats:
                return 0
            # The common chunk: its text strings read without decoding the whole event.
            n = 0
            for raw in _TEXT.findall(data):
                if b"\\" in raw:
                    try:
                        n += len(json.loads(b'"' + raw + b'"').encode("utf-8"))
                    except (ValueError, UnicodeError):
                        n += len(raw)
                else:
                    n += len(raw)
            self.text_bytes += n
            return 1 if n else 0
        try:
            obj = wirejson.loads(data)
        except ValueError:
            return 0
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "message_start" or kind == "message_delta":
            self._messages_usage(obj)
            return 0
        usage = usage_of(obj)
        if usage is not None:
            self.usage = usage
        n = 0 if repeats else completion_text_bytes(obj)
        self.text_bytes += n
        return 1 if n else 0


    def _messages_usage(self, obj: dict[str, Any]) -> None:
        """An Anthropic message_start (message.usage) or message_delta (usage): each
        count is cumulative, so the last one reported stands (never added up)."""
        if obj["type"] == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
        else:
            usage = obj.get("usage")
        if not isinstance(usage, dict):
            return
        prompt = _input_tokens(usage)
        if prompt is not None:
            self.prompt = prompt
        output = _count(usage.get("output_tokens"))
        if output is not None and obj["type"] == "message_delta":
            # message_start's output_tokens is a placeholder (1) before any is generated.
            self.output = output
        if self.prompt is not None and self.output is not None:
            self.usage = (self.prompt, self.output)


class JsonReader:
    """Keeps up to JSON_LIMIT bytes of a JSON response to read its usage at the end;
    past that, the usage fields are searched for in the body's last bytes."""

    __slots__ = ("parts", "size", "tail")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= JSON_LIMIT:
            self.parts.append(chunk)
        else:
            self.parts = []
            self.tail = (self.tail + chunk)[-4096:]

    def result(self) -> tuple[tuple[int, int] | None, int]:
        """(usage, generated text bytes) of the body."""
        if self.parts:
            try:
                obj = wirejson.loads(b"".join(self.parts))
            except ValueError:
                return None, self.size
            return usage_of(obj), completion_text_bytes(obj)
        found = dict(_USAGE_FIELD.findall(self.tail))
        prompt = found.get(b"prompt_tokens", found.get(b"input_tokens"))
        completion = found.get(b"completion_tokens", found.get(b"output_tokens"))
        if prompt is None or completion is None:
            return None, self.size
        cached = sum(int(found.get(k.encode(), 0)) for k in CACHE_FIELDS)
        return (int(prompt) + cached, int(completion)), self.size


def body_model(body: bytes) -> str | None:
    """The "model" a request body names, for a record of a request no LLM filter read
    (one the guard refused): a JSON object's, else what a body that is no JSON seems to
    name. Valid text, at most 200 characters (it goes to logs)."""
    try:
        doc = wirejson.loads(body)
    except ValueError:
        m = _MODEL_ESCAPED.search(body)
        try:
            model = json.loads(b'"' + m.group(1) + b'"') if m is not None else None
        except ValueError:
            return None
    else:
        model = doc.get("model") if isinstance(doc, dict) else None
    return model_text(model)


def model_text(model: object) -> str | None:
    """A request's "model" as the proxy keeps it: a string's first MODEL_CHARS
    characters as valid text (a \\ud800 escape is JSON but no UTF-8), else None."""
    return wirejson.valid_text(model[:MODEL_CHARS]) if isinstance(model, str) else None
