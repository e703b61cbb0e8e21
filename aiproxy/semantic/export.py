"""Write a trained intent model as a self-describing ONNX file (built with the onnx helper API).

Graph (opset 17), kept to as few nodes as possible: for one short text, onnxruntime's cost
is mostly per node, not per multiply.

    ids     int64   [batch, n]      feature ids from the vectorizer, rows padded with 0
    weights float32 [batch, 1, n]   pooling weights (1/n per real id, 0 for padding)

    pooled    = weights @ Gather(E, ids)             # embedding bag   [batch, 1, D]
    hidden    = Relu(pooled @ W1 + b1)               # (when trained with a hidden layer)
    probs     = Softmax(hidden @ W2 (+ b2))          # output "probs"     [batch, 1, classes]
    embedding = LpNormalization(hidden)              # output "embedding" [batch, 1, H or D]
    top_p, top_i = TopK(probs, k)                    # outputs            [batch, 1, k] (k = 3)

A linear model (no hidden layer) trained with `fold` (the default) ships folded instead:

    logits    = (weights @ Gather(T, ids)) * T_scale  # T = E @ W2, int8 [buckets, classes]
    probs     = Softmax(logits (+ b2))
    embedding = LpNormalization(logits)               # [batch, 1, classes]

Otherwise the embedding table is stored as int8 with one scale (folded into W1, or W2 without a
hidden layer: the pooling is linear and the embedding output is normalised), float16
(both Cast after the Gather) or float32, as trained (`--dtype`). Labels, label -> domain
map, feature settings, threshold and training metadata go into metadata_props (keys under
"aiproxy.").

A model trained with word vectors (`--word-vectors`) has a vocabulary: its words, one a
line, in "aiproxy.vocabulary", and word i's row of per-class scores (its frozen vector
times the trained output layer) at T[buckets + i], after the n-gram rows. The vectorizer
emits those ids after the n-gram ids, with their own pooling weights, so the graph is
the same Gather and MatMul.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "aiproxy-intent/1"
OPSET = 17
IR_VERSION = 8


def build_model(weights, classes: list[str], features: dict[str, Any], threshold: float,
                oos_label: str, domains: dict[str, str], training: dict[str, Any],
                top_k: int = 3, vocabulary: list[str] | None = None):
    from onnx import TensorProto, helper, numpy_helper

    if vocabulary:
        if not weights.folded:
            raise ValueError("a vocabulary needs a folded model")
        if len(vocabulary) != weights.E.shape[0] - int(features["buckets"]):
            raise ValueError("vocabulary and table rows disagree")
        if any("\n" in w for w in vocabulary):
            raise ValueError("a vocabulary word has a line break")
    if weights.folded:
        model = _build_folded(weights, classes, features, threshold, oos_label, domains,
                              training, top_k)
        if vocabulary:
            model.metadata_props.add(key="aiproxy.vocabulary", value="\n".join(vocabulary))
        return model
    E = np.ascontiguousarray(weights.E)
    hidden = weights.W1.size > 0
    inits = [numpy_helper.from_array(E, "E")]
    nodes = []
    # an int8 table's scale multiplies the first dense layer (pooling is linear)
    scale = np.float32(weights.E_scale) if E.dtype == np.int8 else np.float32(1.0)
    if E.dtype in (np.float16, np.int8):
        nodes.append(helper.make_node("Gather", ["E", "ids"], ["gathered_q"], axis=0))
        nodes.append(helper.make_node("Cast", ["gathered_q"], ["gathered"], to=TensorProto.FLOAT))
    else:
        nodes.append(helper.make_node("Gather", ["E", "ids"], ["gathered"], axis=0))
    nodes.append(helper.make_node("MatMul", ["weights", "gathered"], ["pooled"]))
    if hidden:
        inits += [numpy_helper.from_array((weights.W1 * scale).astype(np.float32), "W1"),
                  numpy_helper.from_array(weights.b1.astype(np.float32), "b1")]
        nodes += [helper.make_node("MatMul", ["pooled", "W1"], ["z1m"]),
                  helper.make_node("Add", ["z1m", "b1"], ["z1"]),
                  helper.make_node("Relu", ["z1"], ["hidden"])]
        feat, width = "hidden", weights.W1.shape[1]
    else:
        feat, width = "pooled", E.shape[1]
    W2 = weights.W2 if hidden else weights.W2 * scale
    inits += [numpy_helper.from_array(W2.astype(np.float32), "W2"),
              numpy_helper.from_array(weights.b2.astype(np.float32), "b2"),
              numpy_helper.from_array(np.array([min(top_k, len(classes))], np.int64), "k")]
    if np.any(weights.b2):
        nodes += [helper.make_node("MatMul", [feat, "W2"], ["logits_m"]),
                  helper.make_node("Add", ["logits_m", "b2"], ["logits"])]
    else:  # trained without an output bias: one node less per run
        inits = [t for t in inits if t.name != "b2"]
        nodes.append(helper.make_node("MatMul", [feat, "W2"], ["logits"]))
    nodes += [
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("LpNormalization", [feat], ["embedding"], axis=-1, p=2),
        helper.make_node("TopK", ["probs", "k"], ["top_p", "top_i"], axis=-1, largest=1, sorted=1),
    ]
    return _finish(nodes, inits, len(classes), width, classes, features, threshold, oos_label,
                   domains, training)


def _build_folded(weights, classes, features, threshold, oos_label, domains, training, top_k):
    """A linear model whose output layer was folded into the table (`train.fold`):
    logits = weights @ Gather(T, ids) with T = E @ W2. One MatMul less per run, and the cost
    no longer grows with the trained width, so an ensemble's wide table is free at run
    time. An int8 T has one scale per class: a Mul on the pooled logits."""
    from onnx import TensorProto, helper, numpy_helper

    T = np.ascontiguousarray(weights.E)
    inits = [numpy_helper.from_array(T, "T"),
             numpy_helper.from_array(np.array([min(top_k, len(classes))], np.int64), "k")]
    if T.dtype == np.float32:
        nodes = [helper.make_node("Gather", ["T", "ids"], ["gathered"], axis=0)]
    else:
        nodes = [helper.make_node("Gather", ["T", "ids"], ["gathered_q"], axis=0),
                 helper.make_node("Cast", ["gathered_q"], ["gathered"], to=TensorProto.FLOAT)]
    nodes.append(helper.make_node("MatMul", ["weights", "gathered"], ["logits"]))
    if T.dtype == np.int8:
        scale = np.broadcast_to(np.asarray(weights.E_scale, np.float32), (T.shape[1],))
        inits.append(numpy_helper.from_array(np.ascontiguousarray(scale), "T_scale"))
        nodes[-1].output[0] = "logits_q"
        nodes.append(helper.make_node("Mul", ["logits_q", "T_scale"], ["logits"]))
    feat = "logits"
    if np.any(weights.b2):
        inits.append(numpy_helper.from_array(weights.b2.astype(np.float32), "b2"))
        feat = nodes[-1].output[0] = "logits_nb"
        nodes.append(helper.make_node("Add", ["logits_nb", "b2"], ["logits"]))
    nodes += [
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        # the intent embedding: the direction of the pooled per-class scores (where in
        # intent space a text lies), whatever members or width the model was trained with
        helper.make_node("LpNormalization", [feat], ["embedding"], axis=-1, p=2),
        helper.make_node("TopK", ["probs", "k"], ["top_p", "top_i"], axis=-1, largest=1, sorted=1),
    ]
    return _finish(nodes, inits, len(classes), len(classes), classes, features, threshold,
                   oos_label, domains, training)


def _finish(nodes, inits, n_classes, width, classes, features, threshold, oos_label, domains,
            training):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, "aiproxy_intent",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "n"]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["batch", 1, "n"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 1, len(classes)]),
         helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 1, width]),
         helper.make_tensor_value_info("top_p", TensorProto.FLOAT, ["batch", 1, "k"]),
         helper.make_tensor_value_info("top_i", TensorProto.INT64, ["batch", 1, "k"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="aiproxy", doc_string="aiproxy intent classifier")
    model.ir_version = IR_VERSION
    meta = {
        "aiproxy.format": FORMAT,
        "aiproxy.labels": json.dumps(classes),
        "aiproxy.domains": json.dumps({c: domains.get(c, "") for c in classes}),
        "aiproxy.features": json.dumps(features, sort_keys=True),
        "aiproxy.threshold": repr(float(threshold)),
        "aiproxy.oos_label": oos_label,
        "aiproxy.training": json.dumps(training, sort_keys=True, default=str),
    }
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model)
    return model


def save(trained, path: str | Path, domains: dict[str, str] | None = None) -> Path:
    """Write a `train.Trained` result to `path` (.onnx)."""
    import onnx

    domains = dict(domains or {})
    domains.setdefault(trained.cfg.oos_label, trained.cfg.oos_label)
    training = dict(trained.meta)
    training["val_metrics"] = trained.val_metrics
    features = trained.cfg.vectorizer(trained.vocabulary or None).settings()
    model = build_model(trained.weights, trained.classes, features,
                        trained.threshold, trained.cfg.oos_label, domains, training,
                        vocabulary=trained.vocabulary)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path
