"""Responses the proxy produces itself: precomputed status lines and JSON error bodies."""

from __future__ import annotations

import json
from http import HTTPStatus

SERVER = b"aiproxy"

STATUS_LINES: dict[int, bytes] = {}
for _s in HTTPStatus:
    STATUS_LINES[_s.value] = b"HTTP/1.1 %d %s\r\n" % (_s.value, _s.phrase.encode())

CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"

# Machine-readable codes for the errors the proxy itself produces.
DEFAULT_CODES = {
    400: "bad_request",
    404: "no_route",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
    505: "http_version_not_supported",
}


# The proxy's own errors for gRPC callers
# (https://grpc.github.io/grpc/core/md_doc_statuscodes.html), by HTTP status ...
GRPC_STATUS = {400: 13, 401: 16, 403: 7, 404: 12, 408: 4, 413: 8, 429: 8, 431: 8,
               501: 12, 502: 14, 503: 14, 504: 4}
# ... or by error code where the code says more: an upstream's RST_STREAM maps as
# gRPC's PROTOCOL-HTTP2.md "Errors" maps it for a client talking to it directly.
# By error code, where the HTTP status would map to the wrong gRPC status: an auth
# refusal is UNAUTHENTICATED even when it is 400 (RFC 6750 3.1 invalid_request).
GRPC_CODE_STATUS = {"deadline_exceeded": 4, "upstream_cancelled": 1,
                    "upstream_enhance_your_calm": 8, "upstream_inadequate_security": 7,
                    "upstream_stream_error": 13, "unauthorized": 16}


def grpc_status_for(status: int, code: str | None) -> int:
    return GRPC_CODE_STATUS.get(code) or GRPC_STATUS.get(status, 2)


def grpc_status_value(value: bytes | None) -> int:
    """The code a grpc-status field carries; -1 when absent or not a (small) number."""
    if value is None or not 0 < len(value) < 10 or not value.isdigit():
        return -1
    return int(value)


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


def error_body(status: int, code: str | None, message: str) -> bytes:
    payload = {"error": {"code": code or DEFAULT_CODES.get(status, "error"), "message": message}}
    return json.dumps(payload, separators=(",", ":")).encode()


def error_response(status: int, message: str, code: str | None = None, close: bool = True,
                   head_only: bool = False, keep_alive_10: bool = False,
                   headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A complete HTTP/1.1 error response with a JSON body (plus `headers`)."""
    body = error_body(status, code, message)
    if close:
        connection = b"Connection: close\r\n"
    elif keep_alive_10:
        connection = b"Connection: keep-alive\r\n"
    else:
        connection = b""
    if headers:
        connection += b"".join(b"%s: %s\r\n" % h for h in headers)
    head = b"%sServer: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        status_line(status),
        SERVER,
        len(body),
        connection,
    )
    return head if head_only else head + body
