"""Responses the proxy writes itself: status line lookup + JSON error body + head."""

from __future__ import annotations

import json

import pytest

from aiproxy.protocols.replies import error_response

CASES = {
    "404-keepalive": dict(status=404, message="no route matches the request", close=False),
    "502-close": dict(status=502, message="upstream reset the connection", code="upstream_reset"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_response(benchmark, case: str) -> None:
    benchmark.group = "error response"
    kwargs = CASES[case]
    out = error_response(**kwargs)
    _, _, body = out.partition(b"\r\n\r\n")
    assert json.loads(body)["error"]["message"] == kwargs["message"]
    benchmark(error_response, **kwargs)
