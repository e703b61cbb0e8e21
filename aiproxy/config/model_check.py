"""What only the loaded [semantic] model can tell about a config: that the model loads
(a problem), and whether the intents and domains routes match on are ones it predicts
(a warning: a client may still name any intent in the intent header)."""

from __future__ import annotations

import difflib
import tomllib
from typing import Any

from .errors import Problem
from .loader import read_config_text
from .locate import KeyPath, Locator, format_path
from .schema import Config


def load_checked_model(config: Config) -> tuple[Any, list[Problem], list[Problem]]:
    """The intent model (None without [semantic]), the problems found and the warnings,
    each naming the config file, line and key."""
    from aiproxy.semantic.classifier import ModelError
    from aiproxy.server.runtime import load_intent_model

    try:
        text = read_config_text(config.source)
    except Exception:  # noqa: BLE001 - a config given as text: no lines to name
        text = ""
    locator = Locator(text)

    def problem(path: KeyPath, message: str) -> Problem:
        return Problem(config.source, locator.line(path) if text else 0, format_path(path),
                       message)

    try:
        model = load_intent_model(config)
    except ModelError as exc:
        return None, [problem(("semantic", "model"), str(exc))], []
    if model is None or not text:
        return model, [], []
    known = {"intent": set(model.labels),
             "intent_domain": {d for d in model.domains.values() if d}}
    warnings = []
    routes = tomllib.loads(text).get("routes", [])
    for index, route in enumerate(routes if isinstance(routes, list) else []):
        match = route.get("match") if isinstance(route, dict) else None
        if not isinstance(match, dict):
            continue
        for key, names in known.items():
            value = match.get(key)
            if isinstance(value, str) and value not in names:
                close = difflib.get_close_matches(value, sorted(names), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                what = "intent" if key == "intent" else "domain"
                warnings.append(problem(
                    ("routes", index, "match", key),
                    f"the model predicts no {what} '{value}'{hint}: the route matches only "
                    f"requests that name it in {config.semantic.intent_header}"))
    return model, [], warnings
