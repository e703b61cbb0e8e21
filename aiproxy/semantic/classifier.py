"""Intent classification for the proxy: `IntentModel` (one ONNX Runtime session, one
intra-op thread) and `Batcher` (asyncio micro-batching of concurrent requests).

A single classification of the trainer's own graph runs in `LinearHead` (C, same
initializers, same outputs; checked against the session when the model loads):
onnxruntime spends 25-50 us of per-node dispatch on a call that is about 15K
multiply-adds. Batches, `probabilities` and any other graph run in the session.

    model = IntentModel("builtin:clinc150")          # or a path to an .onnx file
    d = model.classify("what's my checking balance")  # Decision(label, confidence, domain, ...)
    batcher = Batcher(model, max_batch=32, max_wait_us=200)
    d = await batcher.classify(text)

A model file is self-describing (see `export.py`): labels, label -> domain map, feature
settings and the confidence threshold below which the label becomes the oos label come
from its metadata. A missing or malformed file raises `ModelError` naming the file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from aiproxy._fast.intent_head import Decision, LinearHead
from aiproxy.semantic.features import vectorizer_from_settings

BUILTIN_DIR = Path(__file__).resolve().parent / "models"
BUILTINS = {"clinc150": BUILTIN_DIR / "clinc150.onnx"}
FORMAT = "aiproxy-intent/1"
PREBOUND = 256  # feature counts whose IOBinding is made at load (see IntentModel._bind)


class ModelError(Exception):
    """An intent model that cannot be used; the message names the file."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def resolve(spec: str | Path) -> Path:
    """Path of a model spec: "builtin:NAME" or a file path."""
    s = str(spec)
    if s.startswith("builtin:"):
        name = s[len("builtin:"):]
        if name not in BUILTINS:
            raise ModelError(s, f"no builtin model {name!r} (have: {', '.join(sorted(BUILTINS))})")
        return BUILTINS[name]
    return Path(s)


def native_head(path: Path, classes: int) -> LinearHead | None:
    """The graph as a LinearHead when it is exactly the one the trainer writes
    (Gather -> Cast -> MatMul -> Mul -> Softmax / LpNormalization(p=2) -> TopK over the
    last axis); None for any other graph, which onnxruntime runs."""
    import onnx
    from onnx import helper, numpy_helper

    try:
        graph = onnx.load(str(path)).graph
    except Exception:  # the session loaded it; anything odd here means "not ours"
        return None
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    shape = [(n.op_type, list(n.input), list(n.output),
              {a.name: helper.get_attribute_value(a) for a in n.attribute})
             for n in graph.node]
    expected = [
        ("Gather", ["T", "ids"], ["gathered_q"], {"axis": 0}),
        ("Cast", ["gathered_q"], ["gathered"], {"to": onnx.TensorProto.FLOAT}),
        ("MatMul", ["weights", "gathered"], ["logits_q"], {}),
        ("Mul", ["logits_q", "T_scale"], ["logits"], {}),
        ("Softmax", ["logits"], ["probs"], {"axis": -1}),
        ("LpNormalization", ["logits"], ["embedding"], {"axis": -1, "p": 2}),
        ("TopK", ["probs", "k"], ["top_p", "top_i"], {"axis": -1, "largest": 1, "sorted": 1}),
    ]
    table, scale = init.get("T"), init.get("T_scale")
    if (shape != expected or table is None or scale is None or table.dtype != np.int8
            or table.ndim != 2 or table.shape[1] != classes or scale.shape != (classes,)):
        return None
    return LinearHead(table, scale.astype(np.float32))


class IntentModel:
    """A loaded intent model. `threshold` overrides the one stored in the model; `top_k`
    is how many (label, prob) pairs a Decision carries.

    `classify` reuses per-model input buffers: call it from one thread at a time (one
    model per worker's event loop, as the proxy does). `classify_batch` and
    `probabilities` allocate their own and may run in another thread meanwhile (the
    Batcher's worker does)."""

    def __init__(self, spec: str | Path = "builtin:clinc150", threshold: float | None = None,
                 top_k: int = 3, max_features: int | None = None, native: bool = True):
        import onnxruntime as ort

        self.path = resolve(spec)
        self.spec = str(spec)
        if not self.path.is_file():
            raise ModelError(self.path, "model file not found")
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(self.path), so,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelError(self.path, f"cannot load ONNX model: {exc}") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self._read_meta(meta)
        except (KeyError, ValueError, TypeError) as exc:
            raise ModelError(self.path, f"not an aiproxy intent model: bad metadata ({exc})") from None
        ins = [i.name for i in self.session.get_inputs()]
        outs = [o.name for o in self.session.get_outputs()]
        if ins != ["ids", "weights"] or not {"probs", "embedding", "top_p", "top_i"} <= set(outs):
            raise ModelError(self.path, f"unexpected graph signature: inputs {ins}, outputs {outs}")
        if threshold is not None:
            self.threshold = float(threshold)
        graph_k = self.session.get_outputs()[outs.index("top_i")].shape[-1]
        graph_k = graph_k if isinstance(graph_k, int) else 3
        self.top_k = max(1, min(int(top_k), len(self.labels)))
        cap = int(max_features or self.vectorizer.max_features)
        self._ids = np.zeros((1, cap), np.int64)
        self._w = np.zeros((1, 1, cap), np.float32)
        self._ids_row = self._ids[0]
        self._w_row = self._w[0, 0]
        # (ids[:, :n], weights[:, :n]) views by n, made once: no array objects per call
        self._views: list[tuple[np.ndarray, np.ndarray] | None] = [None] * (cap + 1)
        # the graph's TopK gives the top labels: no sort in Python on the hot path
        self._fast_top = self.top_k <= graph_k
        self._outputs = ["top_p", "top_i", "embedding"] if self._fast_top else ["probs", "embedding"]
        self._k = self.top_k
        # The session's C++ object: the same call the public run() makes, without its
        # per-call input validation (about 10 microseconds of Python for two inputs).
        self._run = getattr(self.session, "_sess", None)
        self._run = self._run.run if self._run is not None else None
        # Calls of classify/classify_batch that ran the graph (the batcher's tests count
        # them); the proxy calls a native head directly, past this count.
        self.runs = 0
        self._bound = None
        self.native: LinearHead | None = None
        try:
            plain = self.classify("warm up")
            self.classify_batch(["warm up", "a batch of two"])
        except Exception as exc:
            raise ModelError(self.path, f"model does not run: {exc}") from None
        if native:
            self.native = native_head(self.path, len(self.labels))
            if self.native is not None:
                self.native.bind(self._ids_row, self._w_row, self.vectorizer)
                self.native.name(self.labels, self._domain_list, self.oos_label,
                                 self._oos_domain)
                if not self._agrees(plain):
                    self.native = None
        # The session's single-request bindings (about 40 us each, PREBOUND of them) only
        # serve `classify` when the native head does not.
        if self._fast_top and self.native is None:
            self._bound = self._bind(width=int(plain.embedding.shape[0]))
            if self._bound is not None and self.classify("warm up").top != plain.top:
                self._bound = None  # never trust a binding that disagrees
        self.runs = 0

    def _read_meta(self, meta: dict[str, str]) -> None:
        fmt = meta.get("aiproxy.format")
        if fmt != FORMAT:
            raise ValueError(f"aiproxy.format is {fmt!r}, expected {FORMAT!r}")
        self.labels: list[str] = list(json.loads(meta["aiproxy.labels"]))
        domains = json.loads(meta.get("aiproxy.domains", "{}"))
        self.domains: dict[str, str] = {lab: str(domains.get(lab, "")) for lab in self.labels}
        self.features: dict[str, Any] = json.loads(meta["aiproxy.features"])
        size = int(self.features.get("vocabulary_size", 0))
        words = meta["aiproxy.vocabulary"].split("\n") if size else None
        self.vectorizer = vectorizer_from_settings(self.features, words)
        self.threshold = float(meta.get("aiproxy.threshold", "0"))
        self.oos_label = meta.get("aiproxy.oos_label", "oos")
        self.training: dict[str, Any] = json.loads(meta.get("aiproxy.training", "{}"))
        self.metadata = dict(meta)
        self._domain_list = [self.domains[lab] for lab in self.labels]
        oos_domain = self.domains.get(self.oos_label) or self.oos_label
        self._oos_domain = oos_domain

    @property
    def domain_names(self) -> list[str]:
        return sorted({d for d in self.domains.values() if d and d != self._oos_domain})

    # -- running the graph --

    def _bind(self, width: int):
        """Single-request fast path: outputs written into preallocated arrays, and inputs
        bound by pointer into the reused input buffers, in one IOBinding per feature count
        n made the first time a text has n features (`_binding`). A call then only runs
        the binding for its n: the public run() builds feed and fetch objects each time,
        and binding two inputs anew per call costs about 3.5 microseconds. Uses
        onnxruntime's pybind layer, so it falls back to run() when that is not there."""
        try:
            from onnxruntime.capi import _pybind_state as C

            k = self._k
            outs = {"top_p": np.zeros((1, 1, k), np.float32),
                    "top_i": np.zeros((1, 1, k), np.int64),
                    "embedding": np.zeros((1, 1, width), np.float32)}
            dev = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
            self._out = (outs["top_p"][0, 0], outs["top_i"][0, 0], outs["embedding"][0, 0])
            self._bind_spec = (C, dev, outs)
            self._bindings: list = [None] * (self._ids.shape[1] + 1)
            # made now for the usual lengths (a binding takes about 40 us to make, which
            # would otherwise land on the first request of each length)
            for n in range(1, min(PREBOUND, self._ids.shape[1]) + 1):
                self._binding(n)
            return self.session._sess.run_with_iobinding
        except Exception:  # pragma: no cover - depends on the onnxruntime build
            return None

    def _binding(self, n: int):
        """The IOBinding for texts of n features (made once per n; inputs are views of
        the first n entries of the reused buffers, outputs the shared arrays)."""
        C, dev, outs = self._bind_spec
        io = C.SessionIOBinding(self.session._sess)
        io.bind_input("ids", dev, np.dtype(np.int64), [1, n], self._ids.ctypes.data)
        io.bind_input("weights", dev, np.dtype(np.float32), [1, 1, n], self._w.ctypes.data)
        for name, arr in outs.items():
            io.bind_output(name, dev, arr.dtype, list(arr.shape), arr.ctypes.data)
        self._bindings[n] = io
        return io

    def _session_run(self, outputs: list[str], ids: np.ndarray,
                     weights: np.ndarray) -> list[np.ndarray]:
        self.runs += 1
        feeds = {"ids": ids, "weights": weights}
        if self._run is not None:
            return self._run(outputs, feeds, None)
        return self.session.run(outputs, feeds)

    def probabilities(self, texts: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(probs [n, classes], embedding [n, H]) of a batch of texts: one session run."""
        ids, w = self._encode(texts)
        probs, emb = self._session_run(["probs", "embedding"], ids, w)
        return probs[:, 0], emb[:, 0]

    def _encode(self, texts: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
        cap = self._ids.shape[1]
        ids = np.empty((len(texts), cap), np.int64)
        w = np.empty((len(texts), 1, cap), np.float32)
        n = self.vectorizer.encode_batch(texts, ids, w.reshape(len(texts), cap))
        return ids[:, :n], w[:, :, :n]

    def _decision(self, top_p: list[float], top_i: list[int], embedding: np.ndarray) -> Decision:
        labels = self.labels
        k = self._k
        top = [(labels[i], p) for i, p in zip(top_i[:k], top_p[:k], strict=False)]
        conf = top_p[0]
        if conf < self.threshold:
            return Decision(self.oos_label, conf, self._oos_domain, top, embedding)
        return Decision(top[0][0], conf, self._domain_list[top_i[0]], top, embedding)

    def _from_probs(self, probs: np.ndarray, embedding: np.ndarray) -> Decision:
        k = self._k
        part = np.argpartition(probs, -k)[-k:]
        idx = part[np.argsort(-probs[part], kind="stable")]
        return self._decision(probs[idx].tolist(), idx.tolist(), embedding)

    def _agrees(self, plain: Decision) -> bool:
        """The native head gives onnxruntime's answer on the warm-up text."""
        mine = self.classify("warm up")
        return (mine.label == plain.label and [lab for lab, _ in mine.top]
                == [lab for lab, _ in plain.top]
                and np.allclose(mine.embedding, plain.embedding, atol=1e-5)
                and np.allclose([p for _, p in mine.top], [p for _, p in plain.top],
                                atol=1e-5))

    def classify(self, text: str | bytes) -> Decision:
        """Vectorize + one run of the graph + the decision (threshold -> oos label)."""
        if self.native is not None:
            self.runs += 1
            return self.native.classify(text, self._k, self.threshold)
        n = self.vectorizer.encode_into(text, self._ids_row, self._w_row)
        run = self._bound
        if run is not None:
            io = self._bindings[n] or self._binding(n)
            self.runs += 1
            run(io, None)
            top_p, top_i, emb = self._out
            return self._decision(top_p.tolist(), top_i.tolist(), emb.copy())
        views = self._views[n]
        if views is None:
            views = self._views[n] = (self._ids[:, :n], self._w[:, :, :n])
        out = self._session_run(self._outputs, views[0], views[1])
        if self._fast_top:
            return self._decision(out[0][0, 0].tolist(), out[1][0, 0].tolist(), out[2][0, 0])
        return self._from_probs(out[0][0, 0], out[1][0, 0])

    def classify_batch(self, texts: Iterable[str | bytes]) -> list[Decision]:
        texts = list(texts)
        if not texts:
            return []
        ids, w = self._encode(texts)
        out = self._session_run(self._outputs, ids, w)
        if self._fast_top:
            tp, ti, emb = out[0][:, 0].tolist(), out[1][:, 0].tolist(), out[2][:, 0]
            return [self._decision(tp[i], ti[i], emb[i]) for i in range(len(texts))]
        return [self._from_probs(out[0][i, 0], out[1][i, 0]) for i in range(len(texts))]

    def __repr__(self) -> str:
        return f"IntentModel({self.spec!r}, labels={len(self.labels)}, threshold={self.threshold})"


class Batcher:
    """Groups concurrent `classify` calls into one session run.

    The first call of a group waits up to `max_wait_us` microseconds for others (or until
    `max_batch` are queued), then the group runs once in a single worker thread, so the
    event loop keeps serving while the model runs. With `max_wait_us=0` and nothing else
    queued, a call runs inline on the loop: for one request the thread hop costs more
    than the model itself. Measured on the 2-core dev VM (uvloop, builtin model):
    sequential requests p50 33 us inline vs 174 us through the worker thread; bursts of
    32 concurrent requests 47 us/request inline vs 29-33 us/request micro-batched.
    So: max_wait_us=0 (inline) at low concurrency, a small wait when requests pile up.
    """

    def __init__(self, model: IntentModel, max_batch: int = 32, max_wait_us: int = 200,
                 inline_single: bool = True):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model
        self.max_batch = int(max_batch)
        self.max_wait = max(0, int(max_wait_us)) / 1e6
        self.inline_single = inline_single
        self._pending: list[tuple[str | bytes, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiproxy-intent")
        self._running = False
        self.batches = 0
        self.requests = 0

    async def classify(self, text: str | bytes) -> Decision:
        loop = asyncio.get_running_loop()
        self.requests += 1
        if (self.inline_single and self.max_wait == 0 and not self._pending
                and not self._running):
            self.batches += 1
            return self.model.classify(text)
        fut = loop.create_future()
        self._pending.append((text, fut))
        if len(self._pending) >= self.max_batch:
            self._flush(loop)
        elif self._timer is None and not self._running:
            if self.max_wait:
                self._timer = loop.call_later(self.max_wait, self._flush, loop)
            else:
                self._timer = loop.call_soon(self._flush, loop)
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._running or not self._pending:
            return
        group = self._pending[:self.max_batch]
        del self._pending[:self.max_batch]
        self._running = True
        self.batches += 1
        texts = [t for t, _ in group]
        task = loop.run_in_executor(self._executor, self._run_group, texts)
        task.add_done_callback(lambda f: self._done(loop, group, f))

    def _run_group(self, texts: list) -> list:
        """Decisions for a group; if the batch fails, each text alone, so one bad input
        fails only its own request."""
        try:
            return self.model.classify_batch(texts)
        except Exception:
            out: list = []
            for text in texts:
                try:
                    out.append(self.model.classify_batch([text])[0])
                except Exception as exc:
                    out.append(exc)
            return out

    def _done(self, loop, group, f) -> None:
        self._running = False
        exc = f.exception()
        if exc is not None:
            for _, fut in group:
                if not fut.done():
                    fut.set_exception(exc)
        else:
            for (_, fut), decision in zip(group, f.result(), strict=True):
                if fut.done():
                    continue
                if isinstance(decision, Exception):
                    fut.set_exception(decision)
                else:
                    fut.set_result(decision)
        if self._pending:
            # whatever queued while the model ran goes now, as one batch
            self._flush(loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._executor.shutdown(wait=False, cancel_futures=True)
