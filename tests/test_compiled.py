"""The hot-path Python modules run compiled (setup.py: a .py with a .pxd beside it)."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import REPO, compiled_sources

MODULES = [str(p.relative_to(REPO).with_suffix("")).replace("/", ".") for p in compiled_sources()]


def test_the_request_path_is_compiled() -> None:
    assert {"aiproxy.pipeline.exchange", "aiproxy.protocols.http1",
            "aiproxy.protocols.h1_upstream"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_is_an_extension(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__.endswith(".so"), f"{name} runs from {module.__file__}"


def test_fields_are_c_fields() -> None:
    # A field the .pxd does not declare cannot be set: the class has no __dict__.
    from aiproxy.routing.stats import EndpointStats

    stats = EndpointStats()
    stats.requests += 1
    with pytest.raises(AttributeError):
        stats.undeclared = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        stats.requests = "many"  # type: ignore[assignment]
