"""Cache keys: one hash of a request's canonical form, shared by the prompt cache
(`pc:<hash>:<variant>`) and the embedding cache (`ec:<hash>`), so both fill together.

The canonical form is the endpoint plus the JSON body with its keys sorted and the
fields that do not change the answer dropped (`user`, `metadata`): model, messages /
prompt / input and every sampling parameter (temperature, top_p, seed, stop, tools,
max_tokens, stream, ...) take part, so two requests share a key only when an upstream
would see the same question asked the same way. A prompt entry's key adds what else
decides the answer (prompt.variant_of: route, cluster, path and query, Accept-Encoding,
the API version, beta and Origin fields) and whose entry it is.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

IGNORED = frozenset(("user", "metadata"))


def request_hash(kind: str, body: dict[str, Any]) -> str:
    form = {k: v for k, v in body.items() if k not in IGNORED}
    form["~endpoint"] = kind
    blob = json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def context_hash(kind: str, body: dict[str, Any]) -> str:
    """request_hash without the question: the last message when it is the user's, or a
    string prompt / input. A semantic match may differ only there; the system prompt,
    earlier turns, tools, model and every sampling parameter must be equal."""
    form = dict(body)
    messages = form.get("messages")
    if (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "user"):
        form["messages"] = [*messages[:-1], {**messages[-1], "content": None}]
    for name in ("prompt", "input"):
        if isinstance(form.get(name), str):
            form[name] = None
    return request_hash(kind, form)


def prompt_key(h: str, variant: str, scope: str | None) -> str:
    """`pc:<hash>:<variant hash>`: the body's hash, then what else decides the answer
    (the variant: route, cluster, path and query, Accept-Encoding) and, when entries are
    per identity, whose entry it is."""
    tail = variant if scope is None else f"{variant}\x1e{scope}"
    digest = hashlib.blake2b(tail.encode("utf-8", "surrogatepass"), digest_size=16)
    return f"pc:{h}:{digest.hexdigest()}"


def embedding_key(h: str) -> str:
    return "ec:" + h
