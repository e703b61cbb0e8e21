"""Semantic routing: what a request means, in microseconds.

- `unified`: `UnifiedRequest` and `extract()` (OpenAI JSON, gRPC/protobuf without schema,
  image/audio headers, query strings) over at most `inspect_bytes` of a body.
- `aiproxy._fast.intent.Vectorizer`: hashed word/char n-gram feature ids (Cython).
- `classifier`: `IntentModel` (ONNX Runtime, one thread) -> `Decision`, and `Batcher`
  (asyncio micro-batching).
- `train` / `export` / `cli`: `aiproxy router train|eval|classify` (numpy training, ONNX
  export with self-describing metadata).

The shipped model is `builtin:clinc150` (models/clinc150.onnx, `make model` rebuilds it).
"""

from __future__ import annotations

__all__ = ["Batcher", "Decision", "IntentModel", "ModelError", "UnifiedRequest", "extract"]


def __getattr__(name: str):
    # Lazy: importing aiproxy.semantic must not pull in onnxruntime until a model is used.
    if name in ("Batcher", "Decision", "IntentModel", "ModelError"):
        from aiproxy.semantic import classifier

        return getattr(classifier, name)
    if name in ("UnifiedRequest", "extract"):
        from aiproxy.semantic import unified

        return getattr(unified, name)
    raise AttributeError(name)
