"""The semantic layer in the request path: what a request means, decided once per request.

Only routes that match on `intent` / `intent_domain` need it; a config without them pays
nothing. The decision comes from, in order: an explicit intent header (the model is
skipped), or the model run on the UnifiedRequest text of at most `inspect_bytes` of the
body (plus the query string). It is passed upstream as x-aiproxy-intent* headers.
"""

from __future__ import annotations

import logging
import os
import re
import unicodedata
from typing import Any

from aiproxy._fast.intent_head import DecisionLines, confidence_text
from aiproxy.config import SemanticConfig
from aiproxy.semantic.classifier import Batcher, IntentModel, ModelError, resolve
from aiproxy.semantic.unified import extract_text

log = logging.getLogger("aiproxy.semantic")

_ASCII_WORD = re.compile(r"[0-9A-Za-z]")


def has_words(text: str) -> bool:
    """Whether `text` has something the model can read: an ASCII letter or digit, or a
    non-ASCII character that is not a space, separator, control or format character
    (zero-width space, bidi marks). A text without any gives the vectorizer only its
    empty-text feature, and what a model says about that is no reading of the request
    (the shipped one: "calculator" at 0.92)."""
    if _ASCII_WORD.search(text) is not None:
        return True
    for ch in text:
        if ord(ch) > 127 and unicodedata.category(ch)[0] not in "CZ":
            return True
    return False


def model_key(cfg: SemanticConfig) -> tuple:
    """What says the configured model file is still the one loaded. ctime and inode are in
    it, not only mtime: a deploy that renames a new file over the path (or copies one with
    its mtime kept) changes those even when the mtime is the old one's."""
    path = resolve(cfg.model)
    try:
        st = os.stat(path)
        stamp: tuple = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        stamp = ()
    return (str(path), stamp, cfg.threshold, cfg.runtime)


def load_model(cfg: SemanticConfig, previous: SemanticRouter | None = None) -> IntentModel:
    """Load (or reuse, when the file and threshold are unchanged) the configured model.
    Raises ModelError naming the file. Blocking: call it off the event loop."""
    # The key is taken before the file is read: one replaced while it is read then looks
    # changed at the next reload. Taken after, it would vouch for a file never loaded.
    key = model_key(cfg)
    if previous is not None and previous.key == key:
        return previous.model
    model = IntentModel(cfg.model, threshold=cfg.threshold, native=cfg.runtime == "auto")
    model.source_key = key
    return model


class SemanticRouter:
    __slots__ = ("cfg", "model", "key", "header", "inspect_bytes", "json_fields", "batcher",
                 "domains", "decisions", "failures", "explicit", "native", "top_k", "threshold",
                 "decision_lines")

    def __init__(self, cfg: SemanticConfig, model: IntentModel) -> None:
        self.cfg = cfg
        self.model = model
        self.key = getattr(model, "source_key", None) or model_key(cfg)
        self.header = cfg.intent_header.encode()
        self.inspect_bytes = cfg.inspect_bytes
        self.json_fields = cfg.json_fields
        # A model with a native head classifies inline in a few microseconds, less than
        # a batched session run costs per text: it is never batched.
        self.batcher = (Batcher(model, max_batch=cfg.max_batch, max_wait_us=cfg.max_wait_us)
                        if cfg.max_wait_us > 0 and model.native is None else None)
        self.domains: dict[str, str] = model.domains
        # What the exchange calls per request: the model's C head with its arguments
        # (IntentModel.classify minus one Python call), None for an onnxruntime model.
        self.native = model.native
        self.top_k = model.top_k
        self.threshold = model.threshold
        self.decisions: dict[str, int] = {}  # by domain, for /metrics
        self.failures = 0
        self.explicit = 0
        # (intent, domain, confidence) -> the x-aiproxy-intent* lines of an HTTP/1.1
        # upstream request head
        self.decision_lines = DecisionLines()

    @staticmethod
    def decision_fields(intent: str, domain: str | None,
                        confidence: float) -> list[tuple[bytes, bytes]]:
        """The same fields for an HTTP/2 upstream."""
        fields = [(b"x-aiproxy-intent", intent.encode()),
                  (b"x-aiproxy-intent-confidence", confidence_text(confidence))]
        if domain:
            fields.append((b"x-aiproxy-intent-domain", domain.encode()))
        return fields

    def request_text(self, head: Any, body: bytes, target: bytes) -> str:
        """The text the model reads for a request: the body's fields (json_fields) and the
        query string of `target`; "" when that has no word in it (see has_words).
        Raises on content it cannot read."""
        return self.read_text(head, body, target)[0]

    def read_text(self, head: Any, body: bytes, target: bytes) -> tuple[str, str | None]:
        """request_text, and when it is "" why: "no_text" (nothing readable in the body
        and query) or "no_words" (text without a word, see has_words)."""
        q = target.find(b"?")
        text = extract_text(head.get(b"content-type") or b"", body,
                            target[q + 1:] if q >= 0 else b"", self.json_fields,
                            head.content_length if head.content_length >= 0 else None,
                            self.inspect_bytes)
        if not text:
            return "", "no_text"
        # no word in it: routed as a request without text is, without an intent
        return (text, None) if has_words(text) else ("", "no_words")

    def domain_of(self, label: str) -> str | None:
        return self.domains.get(label)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


__all__ = ["SemanticRouter", "load_model", "ModelError"]
