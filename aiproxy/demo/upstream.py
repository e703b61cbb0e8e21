"""Demo upstream: a small aiohttp backend for `make run`, tests and benchmarks.

Endpoints (every response carries ``x-upstream: NAME``):

- ``POST /v1/chat/completions``  OpenAI-compatible chat completion, streamed (SSE) or not.
  The reply is deterministic: "You said: <last user message>", cut to ``max_tokens`` words
  (default 16). ``usage`` counts whitespace-separated words: prompt_tokens over the content of
  all messages, completion_tokens over the reply. Streams send one event per word.
  Also served at Groq's ``/openai/v1/chat/completions`` and Azure OpenAI's
  ``/openai/deployments/{deployment}/chat/completions`` (a body without "model" gets the
  deployment as its model).
- ``POST /v1/messages``           Anthropic Messages API, streamed (SSE) or not, with the same
  deterministic reply ("You said: <last user message>" cut to ``max_tokens`` words, which the
  Messages API requires). ``usage`` counts words too: ``input_tokens`` over ``system`` and all
  messages' text (strings, text blocks, tool_result contents), except blocks that carry
  ``cache_control``, whose words are reported as ``cache_read_input_tokens`` (as if the
  prefix were cached already); ``output_tokens`` over the reply. A stream sends the documented
  events: message_start (its usage with ``output_tokens`` 1), content_block_start, ping, one
  content_block_delta (text_delta) per word, content_block_stop, message_delta (the
  cumulative ``output_tokens``), message_stop. Errors are Anthropic-shaped
  (``{"type": "error", "error": {...}}``).
- ``GET  /v1/models``            OpenAI model list with the single model "demo-model".
- ``ANY  /echo[/{tail}]``        JSON description of the request (method, path, query,
  headers, body_bytes, body_sha256, http_version, upstream); the body is hashed while streaming.
- ``GET  /bytes/{n}``            n bytes of ``pattern(n)``, chunked in 64 KiB pieces;
  ``?length=1`` sends Content-Length instead of chunked encoding.
- ``GET  /sse?n=5&delay_ms=50``  n events "data: event i" (i = 0..n-1), delay_ms apart.
- ``ANY  /status/{code}``        that status with a small JSON body (none for 204 and 304).
- ``ANY  /delay/{ms}``           sleeps ms milliseconds, then 200 "ok".
- ``GET  /ws``                   WebSocket echo for text and binary messages.
- ``GET  /healthz``              200 "ok".

``--report-load PCT`` adds ``x-gpu-mem-used-pct: PCT`` to every response (the
backend-reported load aiproxy's llm_score balancer and rate-limit watermark read).

Run: ``python -m aiproxy.demo.upstream --listen 127.0.0.1:9001 --name demo-a``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

DEFAULT_LISTEN = "127.0.0.1:9001"
DEFAULT_MAX_TOKENS = 16
MODEL_ID = "demo-model"
CHUNK_SIZE = 64 * 1024
# Chat prompts are parsed in memory; /echo streams and is not bound by this.
CLIENT_MAX_SIZE = 64 * 1024 * 1024
NO_BODY_STATUSES = frozenset({204, 304})

_PATTERN = bytes(range(256)) * (CHUNK_SIZE // 256)

NAME_KEY = web.AppKey("name", str)
TOKEN_DELAY_KEY = web.AppKey("token_delay_s", float)
COUNTER_KEY = web.AppKey("counter", itertools.count)
SOCKETS_KEY = web.AppKey("websockets", set)


def pattern(n: int) -> bytes:
    """The body /bytes/{n} sends: byte i is ``i % 256``."""
    return (_PATTERN * (n // len(_PATTERN) + 1))[:n]


def count_tokens(text: str) -> int:
    """Token count used for ``usage``: the number of whitespace-separated words."""
    return len(text.split())


def _content_text(content: Any) -> str:
    # OpenAI allows content as a string or as a list of parts like {"type": "text", "text": ...}.
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def reply_words(messages: list[Any], max_tokens: int) -> list[str]:
    """Words of the reply: "You said: <last user message>" cut to max_tokens words."""
    last = ""
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            last = _content_text(message.get("content"))
    return f"You said: {last}".split()[:max_tokens]


def _prompt_tokens(messages: list[Any]) -> int:
    return sum(
        count_tokens(_content_text(m.get("content"))) for m in messages if isinstance(m, dict)
    )


def openai_error(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        return openai_error(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return openai_error(400, "'messages' must be a non-empty array", param="messages")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return openai_error(400, "'max_tokens' must be a positive integer", param="max_tokens")

    app = request.app
    model = body.get("model")
    if not isinstance(model, str):
        model = request.match_info.get("deployment", MODEL_ID)
    words = reply_words(messages, max_tokens)
    usage = _usage(_prompt_tokens(messages), len(words))
    completion_id = f"chatcmpl-{app[NAME_KEY]}-{next(app[COUNTER_KEY])}"
    created = int(time.time())

    if not body.get("stream"):
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " ".join(words)},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )

    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))

    def chunk(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if include_usage:
            obj["usage"] = None
        return obj

    events: list[dict[str, Any]] = []
    for i, word in enumerate(words):
        # Deltas concatenate to the non-stream content: words after the first carry a space.
        delta = {"role": "assistant", "content": word} if i == 0 else {"content": " " + word}
        events.append(chunk(delta, None))
    if not words:
        events.append(chunk({"role": "assistant", "content": ""}, None))
    events.append(chunk({}, "stop"))
    if include_usage:
        final = chunk({}, None)
        final["choices"] = []
        final["usage"] = usage
        events.append(final)

    resp = _sse_response(cache_control=False)  # as vLLM's: no Cache-Control
    await resp.prepare(request)
    delay = app[TOKEN_DELAY_KEY]
    for i, event in enumerate(events):
        if i and delay:
            await asyncio.sleep(delay)
        # Each write reaches the transport as its own HTTP chunk; write() awaits the drain
        # when the send buffer is over its limit (StreamResponse.drain() is deprecated).
        await resp.write(_sse(event))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def anthropic_error(status: int, message: str,
                    err_type: str = "invalid_request_error") -> web.Response:
    return web.json_response({"type": "error", "error": {"type": err_type, "message": message}},
                             status=status)


def _block_words(content: Any) -> tuple[int, int]:
    """(uncached, cached) words of a Messages API content value: a string, or blocks
    (text, tool_result whose content is a string or blocks); blocks with cache_control
    count as cached."""
    if isinstance(content, str):
        return count_tokens(content), 0
    plain = cached = 0
    if isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            text = block.get("text")
            n = count_tokens(text) if isinstance(text, str) else 0
            if block.get("type") == "tool_result":
                n += sum(_block_words(block.get("content")))
            if block.get("cache_control") is not None:
                cached += n
            else:
                plain += n
    return plain, cached


def _sse_event(name: str, obj: Any) -> bytes:
    return (f"event: {name}\ndata: ".encode() + json.dumps(obj, separators=(",", ":")).encode()
            + b"\n\n")


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: see the module docstring."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        return anthropic_error(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return anthropic_error(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return anthropic_error(400, "model: Field required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return anthropic_error(400, "max_tokens: must be a positive integer")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return anthropic_error(400, "messages: must be a non-empty array")
    plain, cached = _block_words(body.get("system"))
    for m in msgs:
        if isinstance(m, dict):
            p, c = _block_words(m.get("content"))
            plain, cached = plain + p, cached + c
    full = reply_words(msgs, 1 << 30)
    words = full[:max_tokens]
    stop_reason = "max_tokens" if len(full) > max_tokens else "end_turn"
    app = request.app
    message_id = f"msg_{app[NAME_KEY]}_{next(app[COUNTER_KEY])}"
    usage = {"input_tokens": plain, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": cached, "output_tokens": len(words)}
    message: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": " ".join(words)}],
        "stop_reason": stop_reason, "stop_sequence": None, "usage": usage,
    }
    if not body.get("stream"):
        return web.json_response(message)

    start = dict(message, content=[], stop_reason=None, usage=dict(usage, output_tokens=1))
    events: list[bytes] = [
        _sse_event("message_start", {"type": "message_start", "message": start}),
        _sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
        _sse_event("ping", {"type": "ping"}),
    ]
    for i, word in enumerate(words):
        events.append(_sse_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": word if i == 0 else " " + word}}))
    events += [
        _sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": len(words)}}),
        _sse_event("message_stop", {"type": "message_stop"}),
    ]
    resp = _sse_response()
    await resp.prepare(request)
    delay = app[TOKEN_DELAY_KEY]
    for i, event in enumerate(events):
        if i and delay and event.startswith(b"event: content_block_delta"):
            await asyncio.sleep(delay)
        await resp.write(event)
    await resp.write_eof()
    return resp


def _sse_response(cache_control: bool = True) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream"}
    if cache_control:
        headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(headers=headers)
    resp.enable_chunked_encoding()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "aiproxy"}],
        }
    )


async def echo(request: web.Request) -> web.Response:
    digest = hashlib.sha256()
    size = 0
    async for data in request.content.iter_chunked(CHUNK_SIZE):
        digest.update(data)
        size += len(data)
    headers: dict[str, str] = {}
    for key, value in request.headers.items():
        name = key.lower()
        # Repeated headers are folded the way RFC 9110 allows: comma-joined in order.
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return web.json_response(
        {
            "method": request.method,
            "path": request.raw_path.split("?", 1)[0],
            "query": request.query_string,
            "headers": headers,
            "body_bytes": size,
            "body_sha256": digest.hexdigest(),
            "http_version": f"{request.version.major}.{request.version.minor}",
            "upstream": request.app[NAME_KEY],
        }
    )


def _int_param(raw: str, what: str, lo: int, hi: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise web.HTTPBadRequest(text=f"{what} must be an integer in [{lo}, {hi}]\n")
    return value


async def byte_stream(request: web.Request) -> web.StreamResponse:
    n = _int_param(request.match_info["n"], "n", 0, 1 << 40)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    if request.query.get("length") == "1":
        resp.content_length = n
    else:
        resp.enable_chunked_encoding()
    await resp.prepare(request)
    if request.method != "HEAD":
        sent = 0
        while sent < n:
            piece = min(CHUNK_SIZE, n - sent)
            await resp.write(_PATTERN[:piece])
            sent += piece
    await resp.write_eof()
    return resp


async def sse(request: web.Request) -> web.StreamResponse:
    n = _int_param(request.query.get("n", "5"), "n", 0, 1_000_000)
    delay = _int_param(request.query.get("delay_ms", "50"), "delay_ms", 0, 3_600_000) / 1000
    resp = _sse_response()
    await resp.prepare(request)
    for i in range(n):
        if i and delay:
            await asyncio.sleep(delay)
        await resp.write(f"data: event {i}\n\n".encode())
    await resp.write_eof()
    return resp


async def status(request: web.Request) -> web.Response:
    code = _int_param(request.match_info["code"], "code", 200, 599)
    if code in NO_BODY_STATUSES:
        return web.Response(status=code)
    return web.json_response({"status": code}, status=code)


async def delay(request: web.Request) -> web.Response:
    ms = _int_param(request.match_info["ms"], "ms", 0, 3_600_000)
    await asyncio.sleep(ms / 1000)
    return web.Response(text="ok")


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    sockets = request.app[SOCKETS_KEY]
    sockets.add(ws)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
    finally:
        sockets.discard(ws)
    return ws


async def _close_websockets(app: web.Application) -> None:
    for ws in list(app[SOCKETS_KEY]):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _upstream_header(name: str, load: float | None = None
                     ) -> Callable[[web.Request, web.StreamResponse], Any]:
    async def add_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-upstream"] = name
        if load is not None:
            response.headers["x-gpu-mem-used-pct"] = f"{load:g}"

    return add_header


@web.middleware
async def _quiet_disconnects(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ConnectionError:
        # The client hung up mid-body or mid-stream, which tests do on purpose; aiohttp would
        # log a traceback. This placeholder is never delivered: the connection is gone.
        return web.Response(status=499)


def build_app(name: str, token_delay_ms: float = 20,
              report_load: float | None = None) -> web.Application:
    """The demo upstream application; ``name`` goes into ``x-upstream`` and /echo replies."""
    app = web.Application(client_max_size=CLIENT_MAX_SIZE, middlewares=[_quiet_disconnects])
    app[NAME_KEY] = name
    app[TOKEN_DELAY_KEY] = token_delay_ms / 1000
    app[COUNTER_KEY] = itertools.count(1)
    app[SOCKETS_KEY] = set()
    app.on_shutdown.append(_close_websockets)
    # on_response_prepare also covers streamed, WebSocket and router-generated error responses.
    app.on_response_prepare.append(_upstream_header(name, report_load))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/openai/v1/chat/completions", chat_completions)
    app.router.add_post("/openai/deployments/{deployment}/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/echo", echo)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_get("/bytes/{n}", byte_stream)
    app.router.add_get("/sse", sse)
    app.router.add_route("*", "/status/{code}", status)
    app.router.add_route("*", "/delay/{ms}", delay)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/healthz", healthz)
    return app


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[::1]:PORT``) into host and port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="aiproxy demo-upstream", description="Run the aiproxy demo upstream server."
    )
    parser.add_argument(
        "--listen",
        type=parse_listen,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_LISTEN})",
    )
    parser.add_argument("--name", default="demo", help="name sent in x-upstream (default demo)")
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=20,
        metavar="N",
        help="delay between streamed chat completion events and Messages API text deltas "
        "(default 20)",
    )
    parser.add_argument(
        "--report-load",
        type=float,
        default=None,
        metavar="PCT",
        help="send x-gpu-mem-used-pct: PCT on every response",
    )
    args = parser.parse_args(argv)
    if args.token_delay_ms < 0:
        parser.error("--token-delay-ms must be >= 0")
    host, port = args.listen

    def announce(_message: str) -> None:
        # run_app calls this once the socket is bound, so the line means "ready".
        print(f"demo-upstream {args.name} listening on {host}:{port}", file=sys.stderr, flush=True)

    try:
        web.run_app(
            build_app(args.name, args.token_delay_ms, args.report_load),
            host=host,
            port=port,
            print=announce,
            access_log=None,
            # In-flight streams get this long (twice: finish, then cancel) instead of 60 s, so
            # tests that stop and restart upstreams are not held up.
            shutdown_timeout=0.25,
            loop=_new_loop(),
        )
    except OSError as exc:
        # Most often the port is taken; say so in one line rather than a traceback.
        print(f"demo-upstream {args.name}: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
