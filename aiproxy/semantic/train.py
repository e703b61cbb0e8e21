"""Numpy training of the intent classifier (no torch).

Model (fastText-style, plus one hidden layer):

    pooled = sum_k w_k * E[id_k]          # embedding bag, w_k = 1/n (mean) or 1/sqrt(n)
    hidden = relu(pooled @ W1 + b1)       # H units (H = 0: no hidden layer)
    probs  = softmax(hidden @ W2 + b2)

With pretrained word vectors (`word_vectors`, linear folded models only), the logits get
a second term: the mean of the frozen vectors of the text's vocabulary words times a
trained output layer Wv; folding turns each word's vector @ Wv into its own table row.

Trained with Adam on shuffled mini-batches (sparse "lazy" Adam for the embedding
table: only rows a batch touches are updated), dropout on the pooled vector and the
hidden layer, and optional word dropout. Everything random comes from one
`numpy.random.Generator(seed)`, so a seed gives the same weights on every run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiproxy._fast.intent import Vectorizer


@dataclass
class TrainConfig:
    buckets: int = 1 << 15
    seed: int = 1
    word_ngrams: int = 3
    char_min: int = 3
    char_max: int = 5
    max_features: int = 2048
    pooling: str = "mean"
    dim: int = 128
    hidden: int = 0            # 0: linear head on the pooled vector (fastest; as accurate here)
    epochs: int = 10
    batch: int = 32
    lr: float = 0.01
    lr_embed: float = 0.03
    lr_decay: float = 0.1      # final lr = lr * lr_decay (linear)
    dropout: float = 0.3       # on the pooled vector
    feature_dropout: float = 0.0  # drop this share of a text's features per step
    hidden_dropout: float = 0.3
    weight_decay: float = 0.0  # L2 on dense weights
    label_smoothing: float = 0.0
    output_bias: bool = False  # no output bias: one graph node less, same accuracy here
    average_from: int = 4      # >0: final weights = mean of the weights after each epoch from this one
    oos_label: str = "oos"
    threshold_target: float = 0.55  # oos recall the threshold search aims for
    dtype: str = "int8"           # embedding table as shipped: int8 (per-row scale), float16, float32
    ensemble: int = 1          # members trained from different seeds, logits averaged in one graph
    fold: bool = True          # linear model: ship E @ W2 as the table (see fold)
    word_vectors: str = ""     # pretrained word vectors (wordvec.SOURCES), frozen: "" for none
    vocab_top: int = 0         # with word_vectors: also the N most frequent words not in train
    vocab_scale: float = 1.0   # the word vectors are multiplied by this
    vocab_dropout: float = 0.0  # drop a text's whole word-vector input with this probability
    # >0 with word_vectors: the `ensemble` members are trained without word vectors, and
    # this many more (same member seeds) with them, of which only the vocabulary rows are
    # kept, times word_vector_weight (see _add_vocabulary)
    word_vector_members: int = 0
    word_vector_weight: float = 0.5

    def feature_settings(self) -> dict[str, Any]:
        return self.vectorizer().settings()

    def vectorizer(self, vocabulary: list[str] | None = None) -> Vectorizer:
        return Vectorizer(buckets=self.buckets, seed=self.seed, word_ngrams=self.word_ngrams,
                          char_min=self.char_min, char_max=self.char_max,
                          max_features=self.max_features, pooling=self.pooling,
                          vocabulary=vocabulary)


@dataclass
class Dataset:
    texts: list[str]
    labels: list[str]
    files: list[str] = field(default_factory=list)
    domains: dict[str, str] = field(default_factory=dict)  # label -> domain seen in rows


def load_jsonl(paths: list[str] | tuple[str, ...], text_field: str = "text",
               label_field: str = "intent", domain_field: str | None = "domain") -> Dataset:
    """Rows of JSON-lines files; `domain_field` (when a row has it) builds label -> domain."""
    texts: list[str] = []
    labels: list[str] = []
    domains: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                    text, label = row[text_field], row[label_field]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: cannot read row "
                                     f"({text_field!r}/{label_field!r}): {exc}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: a row must be a JSON object")
                texts.append(str(text))
                labels.append(str(label))
                if domain_field and domain_field in row:
                    domains.setdefault(str(label), str(row[domain_field]))
    return Dataset(texts, labels, [str(p) for p in paths], domains)


def featurize(vec: Vectorizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ids, flat pooling weights and offsets (len(texts) + 1) for a list of texts."""
    buf = np.empty(vec.max_features, dtype=np.int64)
    wbuf = np.empty(vec.max_features, dtype=np.float32)
    chunks, wchunks = [], []
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    for i, text in enumerate(texts):
        n = vec.encode_into(text, buf, wbuf)
        chunks.append(buf[:n].copy())
        wchunks.append(wbuf[:n].copy())
        offsets[i + 1] = offsets[i] + n
    return np.concatenate(chunks), np.concatenate(wchunks), offsets


@dataclass
class Weights:
    E: np.ndarray   # [buckets, dim]
    W1: np.ndarray  # [dim, hidden] (empty when hidden == 0)
    b1: np.ndarray
    W2: np.ndarray  # [hidden or dim, classes]
    b2: np.ndarray
    E_scale: float | np.ndarray | None = None  # E = int8 table * E_scale (or per column)
    folded: bool = False  # E is E @ W2 of a linear model, W2 the identity (see fold)
    V: np.ndarray | None = None   # [words, dv] frozen word vectors of the vocabulary ids
    Wv: np.ndarray | None = None  # [dv, classes]: their pooled vector's output layer

    def dense_E(self) -> np.ndarray:
        if self.E.dtype == np.int8:
            return self.E.astype(np.float32) * np.asarray(self.E_scale, np.float32)
        return self.E.astype(np.float32) if self.E.dtype != np.float32 else self.E


def fold(weights: Weights) -> Weights:
    """A linear model (no hidden layer) as one table of per-feature logits: pooling and the
    output layer are both linear, so weights @ (E @ W2)[ids] gives the same logits with
    one matrix product less per run, and with a table as wide as the class count whatever
    width (or ensemble) it was trained with."""
    if weights.W1.size or weights.folded:
        return weights
    T = weights.dense_E() @ weights.W2.astype(np.float32)
    if weights.V is not None:  # the vocabulary ids' rows follow the buckets
        T = np.concatenate([T, weights.V @ weights.Wv.astype(np.float32)])
    C = T.shape[1]
    return Weights(T.astype(np.float32), weights.W1, weights.b1, np.eye(C, dtype=np.float32),
                   weights.b2, folded=True)


def combine(members: list[Weights]) -> Weights:
    """One model whose logits are the mean of the members' logits. Pooling is linear, so
    the members' tables side by side give every member's pooled vector in one Gather; the
    hidden layers become one block-diagonal layer and the output layers are stacked and
    divided by the member count: the graph keeps its nodes, only wider."""
    if len(members) == 1:
        return members[0]
    k = np.float32(len(members))
    E = np.concatenate([m.dense_E() for m in members], axis=1)
    if members[0].W1.size:
        rows = sum(m.W1.shape[0] for m in members)
        cols = sum(m.W1.shape[1] for m in members)
        W1 = np.zeros((rows, cols), np.float32)
        r = c = 0
        for m in members:
            W1[r:r + m.W1.shape[0], c:c + m.W1.shape[1]] = m.W1
            r, c = r + m.W1.shape[0], c + m.W1.shape[1]
        b1 = np.concatenate([m.b1 for m in members])
    else:
        W1, b1 = members[0].W1, members[0].b1
    W2 = np.concatenate([m.W2 for m in members], axis=0) / k
    b2 = sum(m.b2 for m in members) / k
    Wv = None if members[0].Wv is None else (sum(m.Wv for m in members) / k).astype(np.float32)
    return Weights(E, W1, b1, W2.astype(np.float32), np.asarray(b2, np.float32),
                   V=members[0].V, Wv=Wv)


def quantize(weights: Weights, dtype: str) -> Weights:
    """The embedding table as shipped: int8 with one scale for the table (the export folds
    it into the next layer's weights, so it costs nothing at run time; on CLINC150 this
    loses no accuracy against float32), float16, or float32 as trained."""
    E = weights.E.astype(np.float32)
    rest = (weights.W1, weights.b1, weights.W2, weights.b2)
    if dtype == "int8":
        if weights.folded:  # columns are classes, of different ranges: a scale per class
            scale = np.abs(E).max(axis=0) / np.float32(127.0)
            scale[scale == 0] = 1.0
        else:
            scale = float(np.abs(E).max()) / 127.0 or 1.0
        q = np.clip(np.rint(E / scale), -127, 127).astype(np.int8)
        return Weights(q, *rest, scale, folded=weights.folded)
    if dtype == "float16":
        return Weights(E.astype(np.float16), *rest, folded=weights.folded)
    if dtype == "float32":
        return Weights(E, *rest, folded=weights.folded)
    raise ValueError(f"unknown dtype {dtype!r}")


class _Adam:
    def __init__(self, shape, lr: float, b1=0.9, b2=0.999, eps=1e-8):
        self.m = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.t = 0

    def step(self, p, g, scale=1.0):
        self.t += 1
        self.m *= self.b1
        self.m += (1 - self.b1) * g
        self.v *= self.b2
        self.v += (1 - self.b2) * g * g
        lr = self.lr * scale * np.sqrt(1 - self.b2 ** self.t) / (1 - self.b1 ** self.t)
        p -= lr * self.m / (np.sqrt(self.v) + self.eps)


class _LazyAdam:
    """Adam on the rows a batch touched (per-row step counts for the bias correction)."""

    def __init__(self, shape, lr: float, b1=0.9, b2=0.999, eps=1e-8):
        self.m = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.t = np.zeros(shape[0], np.int32)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def step(self, p, rows, g, scale=1.0):
        self.t[rows] += 1
        t = self.t[rows].astype(np.float32)[:, None]
        m = self.b1 * self.m[rows] + (1 - self.b1) * g
        v = self.b2 * self.v[rows] + (1 - self.b2) * g * g
        self.m[rows] = m
        self.v[rows] = v
        lr = self.lr * scale * np.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        p[rows] -= lr * m / (np.sqrt(v) + self.eps)


def _pool(E, ids, w, offsets, rows):
    """Pooled vectors for example indices `rows`; also the flat occurrence arrays."""
    starts, ends = offsets[rows], offsets[rows + 1]
    lens = ends - starts
    occ = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(lens.sum())
    bid = ids[occ]
    bw = w[occ]
    seg = np.concatenate(([0], np.cumsum(lens)[:-1]))
    pooled = np.add.reduceat(E[bid] * bw[:, None], seg, axis=0)
    ex = np.repeat(np.arange(len(rows)), lens)
    return pooled.astype(np.float32), bid, bw, ex


def _batch_matrix(ids, w, offsets, rows, cfg, rng):
    """The batch as a dense (len(rows) x U) matrix of pooling weights over the U distinct
    ids it touches (returned sorted): pooled = A @ E[u] and the table's gradient is
    A.T @ d_pooled, two small BLAS products instead of a gather and scatter per
    occurrence. With `cfg.feature_dropout`, a random share of each text's features is
    dropped (at least one kept) and the pooling weights are recomputed for the ones kept."""
    starts, ends = offsets[rows], offsets[rows + 1]
    lens = ends - starts
    first = np.concatenate(([0], np.cumsum(lens)[:-1]))
    occ = np.repeat(starts - first, lens) + np.arange(lens.sum())
    ex = np.repeat(np.arange(len(rows)), lens)
    if cfg.feature_dropout:
        keep = rng.random(len(occ)) >= cfg.feature_dropout
        keep[first] = True
        occ, ex = occ[keep], ex[keep]
        kept = np.bincount(ex, minlength=len(rows)).astype(np.float32)
        bw = (1.0 / np.sqrt(kept) if cfg.pooling == "sqrt" else 1.0 / kept)[ex]
    else:
        bw = w[occ]
    u, inv = np.unique(ids[occ], return_inverse=True)
    A = np.bincount(ex * len(u) + inv, weights=bw, minlength=len(rows) * len(u))
    return u, A.reshape(len(rows), len(u)).astype(np.float32)


def forward(weights: Weights, ids, w, offsets, rows=None, batch=2048):
    """Class probabilities and hidden activations for the given examples (no dropout)."""
    probs, hid = [], []
    E = weights.dense_E()
    rows = np.arange(len(offsets) - 1) if rows is None else rows
    for i in range(0, len(rows), batch):
        r = rows[i:i + batch]
        p, _, _, _ = _pool(E, ids, w, offsets, r)
        if weights.W1.size:
            h = np.maximum(p @ weights.W1 + weights.b1, 0)
        else:
            h = p
        z = h @ weights.W2 + weights.b2
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        probs.append(e / e.sum(axis=1, keepdims=True))
        hid.append(h)
    return np.concatenate(probs), np.concatenate(hid)


def split_vocabulary(ids, w, offsets, buckets: int, V: np.ndarray):
    """The n-gram part of featurized texts (ids < buckets) and, for the vocabulary ids
    (buckets + word index), each text's pooled word vector [texts, dv] with their
    pooling weights: the frozen input of the word-vector path."""
    n = len(offsets) - 1
    ex = np.repeat(np.arange(n), np.diff(offsets))
    words = ids >= buckets
    G = np.zeros((n, V.shape[1]), np.float32)
    np.add.at(G, ex[words], V[ids[words] - buckets] * w[words][:, None])
    keep = ~words
    off = np.zeros(n + 1, np.int64)
    off[1:] = np.cumsum(np.bincount(ex[keep], minlength=n))
    return ids[keep], w[keep], off, G


def train_weights(cfg: TrainConfig, ids, w, offsets, y: np.ndarray, n_classes: int,
                  log=None, on_epoch=None, member: int = 0, G: np.ndarray | None = None,
                  V: np.ndarray | None = None) -> Weights:
    """One member. With `G` (each text's pooled frozen word vector, see split_vocabulary)
    the logits get a second linear term G @ Wv; `V` (the vocabulary's vectors) goes
    into the returned Weights for `fold`."""
    rng = np.random.default_rng([cfg.seed, member])
    D, H, C = cfg.dim, cfg.hidden, n_classes
    E = rng.uniform(-1.0 / D, 1.0 / D, (cfg.buckets, D)).astype(np.float32)
    if H:
        W1 = (rng.standard_normal((D, H)) * np.sqrt(2.0 / D)).astype(np.float32)
        b1 = np.zeros(H, np.float32)
        W2 = (rng.standard_normal((H, C)) * np.sqrt(1.0 / H)).astype(np.float32)
    else:
        W1 = np.zeros((0, 0), np.float32)
        b1 = np.zeros(0, np.float32)
        W2 = np.zeros((D, C), np.float32)
    b2 = np.zeros(C, np.float32)
    optE = _LazyAdam(E.shape, cfg.lr_embed)
    dense = [W1, b1, W2, b2] if H else [W2, b2]
    if G is not None:
        if H:
            raise ValueError("word vectors need a linear model (hidden 0)")
        Wv = np.zeros((G.shape[1], C), np.float32)
        dense.append(Wv)
    opts = [_Adam(p.shape, cfg.lr) for p in dense]
    n = len(y)
    steps_total = cfg.epochs * ((n + cfg.batch - 1) // cfg.batch)
    step = 0
    avg: list[np.ndarray] | None = None
    n_avg = 0
    eye = np.eye(C, dtype=np.float32)
    if cfg.label_smoothing:
        eye = eye * (1 - cfg.label_smoothing) + cfg.label_smoothing / C
    for epoch in range(cfg.epochs):
        order = rng.permutation(n)
        loss_sum = 0.0
        for i in range(0, n, cfg.batch):
            rows = order[i:i + cfg.batch]
            B = len(rows)
            scale = 1.0 - (1.0 - cfg.lr_decay) * step / max(1, steps_total)
            step += 1
            u, A = _batch_matrix(ids, w, offsets, rows, cfg, rng)
            p = A @ E[u]
            if cfg.dropout:
                mp = (rng.random(p.shape) >= cfg.dropout).astype(np.float32) / (1 - cfg.dropout)
                p = p * mp
            if H:
                z1 = p @ W1 + b1
                h = np.maximum(z1, 0)
                if cfg.hidden_dropout:
                    mh = (rng.random(h.shape) >= cfg.hidden_dropout).astype(np.float32)
                    mh /= (1 - cfg.hidden_dropout)
                    h = h * mh
            else:
                h = p
            z = h @ W2 + b2
            if G is not None:
                g = G[rows]
                if cfg.vocab_dropout:
                    keep = rng.random(B) >= cfg.vocab_dropout
                    g = g * (keep[:, None] / np.float32(1 - cfg.vocab_dropout))
                z = z + g @ Wv
            z -= z.max(axis=1, keepdims=True)
            e = np.exp(z)
            prob = e / e.sum(axis=1, keepdims=True)
            t = eye[y[rows]]
            loss_sum += float(-(t * np.log(prob + 1e-9)).sum())
            dz = (prob - t) / B
            gW2 = h.T @ dz
            gb2 = dz.sum(axis=0) if cfg.output_bias else np.zeros_like(b2)
            dh = dz @ W2.T
            if H:
                if cfg.hidden_dropout:
                    dh *= mh
                dz1 = dh * (z1 > 0)
                gW1 = p.T @ dz1
                gb1 = dz1.sum(axis=0)
                dp = dz1 @ W1.T
                grads = [gW1, gb1, gW2, gb2]
            else:
                dp = dh
                grads = [gW2, gb2]
            if G is not None:
                grads.append(g.T @ dz)
            if cfg.dropout:
                dp *= mp
            if cfg.weight_decay:
                grads = [g + cfg.weight_decay * prm if g.ndim == 2 else g
                         for g, prm in zip(grads, dense, strict=True)]
            for opt, prm, g in zip(opts, dense, grads, strict=True):
                opt.step(prm, g.astype(np.float32), scale)
            optE.step(E, u, A.T @ dp.astype(np.float32), scale)
        if log:
            log(f"epoch {epoch + 1}/{cfg.epochs} loss {loss_sum / n:.4f}")
        current = [E, W1, b1, W2, b2] + ([Wv] if G is not None else [])
        if cfg.average_from and epoch + 1 >= cfg.average_from:
            n_avg += 1
            if avg is None:
                avg = [p.copy() for p in current]
            else:
                for a, p in zip(avg, current, strict=True):
                    a += (p - a) / n_avg  # running mean
            current = avg
        if on_epoch:
            on_epoch(epoch + 1, _weights(current, V))
    return _weights(avg if avg is not None else current, V)


def _weights(params: list[np.ndarray], V: np.ndarray | None) -> Weights:
    if len(params) > 5:
        return Weights(*params[:5], V=V, Wv=params[5])
    return Weights(*params)


# ---- metrics and threshold ----

def predict_labels(probs: np.ndarray, classes: list[str], threshold: float,
                   oos_label: str) -> list[str]:
    top = probs.argmax(axis=1)
    conf = probs[np.arange(len(top)), top]
    return [oos_label if c < threshold else classes[k] for k, c in zip(top, conf, strict=True)]


def metrics(pred: list[str], gold: list[str], oos_label: str = "oos") -> dict[str, Any]:
    gold_a = np.array(gold, dtype=object)
    pred_a = np.array(pred, dtype=object)
    ins = gold_a != oos_label
    out: dict[str, Any] = {"rows": len(gold)}
    out["accuracy"] = float((pred_a[ins] == gold_a[ins]).mean()) if ins.any() else None
    labels = sorted(set(gold) | set(pred))
    f1s = []
    for lab in labels:
        if lab == oos_label:
            continue
        tp = int(((pred_a == lab) & (gold_a == lab)).sum())
        fp = int(((pred_a == lab) & (gold_a != lab)).sum())
        fn = int(((pred_a != lab) & (gold_a == lab)).sum())
        if tp + fp + fn == 0:
            continue
        f1s.append(2 * tp / (2 * tp + fp + fn))
    out["macro_f1"] = float(np.mean(f1s)) if f1s else None
    oos = ~ins
    if oos.any():
        tp = int(((pred_a == oos_label) & oos).sum())
        predicted = int((pred_a == oos_label).sum())
        out["oos_rows"] = int(oos.sum())
        out["oos_recall"] = tp / int(oos.sum())
        out["oos_precision"] = tp / predicted if predicted else 0.0
    return out


def choose_threshold(probs: np.ndarray, classes: list[str], gold: list[str], oos_label: str,
                     target_recall: float, step: float = 0.001) -> tuple[float, dict[str, Any]]:
    """Lowest confidence threshold (a multiple of `step`) whose oos recall reaches
    `target_recall`: the least in-scope accuracy given up for it. Without oos rows, 0; when
    no threshold below 0.95 reaches the target, the one with the best accuracy + recall."""
    if oos_label not in gold:
        return 0.0, metrics(predict_labels(probs, classes, 0.0, oos_label), gold, oos_label)
    top = probs.argmax(axis=1)
    conf = probs[np.arange(len(top)), top]
    oos = np.array([g == oos_label for g in gold])
    caught = top[oos] == classes.index(oos_label) if oos_label in classes else np.zeros(
        int(oos.sum()), bool)
    grid = np.round(np.arange(0.0, 0.95 + step / 2, step), 6)
    # recall at each threshold: oos rows predicted oos, or below the threshold
    recall = ((conf[oos][None, :] < grid[:, None]) | caught[None, :]).mean(axis=1)
    hit = np.flatnonzero(recall >= target_recall)
    if hit.size:
        t = float(grid[hit[0]])
        return t, metrics(predict_labels(probs, classes, t, oos_label), gold, oos_label)
    best = None
    for t in grid[::10]:
        m = metrics(predict_labels(probs, classes, float(t), oos_label), gold, oos_label)
        score = m["accuracy"] + m["oos_recall"]
        if best is None or score > best[0]:
            best = (score, float(t), m)
    return best[1], best[2]


@dataclass
class Trained:
    cfg: TrainConfig
    classes: list[str]
    weights: Weights
    threshold: float
    val_metrics: dict[str, Any] | None
    meta: dict[str, Any]
    vocabulary: list[str] = field(default_factory=list)  # word i has feature id buckets + i


def train(cfg: TrainConfig, data: Dataset, val: Dataset | None = None, log=None,
          jobs: int = 1) -> Trained:
    t0 = time.time()
    vocab: list[str] = []
    V = G = None
    if cfg.word_vector_members and not cfg.word_vectors:
        raise ValueError("word_vector_members needs word_vectors")
    if cfg.word_vectors:
        if cfg.hidden or not cfg.fold:
            raise ValueError("word vectors need a linear, folded model (hidden 0, fold)")
        from aiproxy.semantic import wordvec

        words, vectors = wordvec.load(cfg.word_vectors)
        vocab, V = wordvec.vocabulary(words, vectors, data.texts, cfg.vocab_top)
        V = V * np.float32(cfg.vocab_scale)
        if log:
            log(f"vocabulary: {len(vocab)} words with {cfg.word_vectors} vectors")
    vec = cfg.vectorizer(vocab or None)
    classes = sorted(set(data.labels))
    index = {c: i for i, c in enumerate(classes)}
    y = np.array([index[lab] for lab in data.labels], dtype=np.int64)
    ids, w, offsets = featurize(vec, data.texts)
    if V is not None:
        ids, w, offsets, G = split_vocabulary(ids, w, offsets, cfg.buckets, V)
    k = max(1, cfg.ensemble)
    # (member seed, word vectors?) of each member
    jobs_list = [(m, G is not None and not cfg.word_vector_members) for m in range(k)]
    jobs_list += [(m, True) for m in range(cfg.word_vector_members)]
    if jobs > 1 and len(jobs_list) > 1:
        # members are independent (each has its own generator): one process each, same
        # weights as one after the other
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        n_proc = min(jobs, len(jobs_list))
        if log:
            log(f"training {len(jobs_list)} members in {n_proc} processes")
        with ProcessPoolExecutor(n_proc, mp_context=multiprocessing.get_context("fork")) as ex:
            futures = [ex.submit(train_weights, cfg, ids, w, offsets, y, len(classes),
                                 member=m, **({"G": G, "V": V} if wv else {}))
                       for m, wv in jobs_list]
            members = [f.result() for f in futures]
    else:
        members = []
        for i, (m, wv) in enumerate(jobs_list):
            if log and len(jobs_list) > 1:
                log(f"member {i + 1}/{len(jobs_list)}")
            members.append(train_weights(cfg, ids, w, offsets, y, len(classes), log=log,
                                         member=m, **({"G": G, "V": V} if wv else {})))
    if cfg.word_vector_members:
        weights = _add_vocabulary(members[:k], members[k:], cfg.word_vector_weight)
    else:
        weights = combine(members)
        if cfg.fold:
            weights = fold(weights)
    weights = quantize(weights, cfg.dtype)
    threshold, val_metrics = 0.0, None
    if val is not None and val.texts:
        vids, vw, voff = featurize(vec, val.texts)
        probs, _ = forward(weights, vids, vw, voff)
        threshold, val_metrics = choose_threshold(probs, classes, val.labels, cfg.oos_label,
                                                  cfg.threshold_target)
    meta = {
        "data": data.files,
        "rows": len(data.texts),
        "val": val.files if val is not None else [],
        "val_rows": len(val.texts) if val is not None else 0,
        "seed": cfg.seed,
        "config": asdict(cfg),
        "train_seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    if vocab:
        meta["vocabulary"] = {"source": cfg.word_vectors, "words": len(vocab),
                              "top": cfg.vocab_top}
    return Trained(cfg, classes, weights, threshold, val_metrics, meta, vocab)


def _add_vocabulary(plain: list[Weights], with_vectors: list[Weights],
                    weight: float) -> Weights:
    """The n-gram members' folded table, plus the vocabulary rows (each word's vector times
    the output layer) of the members trained with word vectors, times `weight`. Trained
    jointly, the word-vector members' own n-gram rows are weaker than the n-gram-only
    members' (they lean on the vectors), and averaging the two whole tables, or using
    the word-vector members alone, makes out-of-scope texts more confident; adding only
    the word terms to the n-gram-only model keeps its n-gram scores (README, Semantic
    routing)."""
    a, b = fold(combine(plain)), fold(combine(with_vectors))
    rows = a.E.shape[0]
    T = np.concatenate([a.E, np.float32(weight) * b.E[rows:]]).astype(np.float32)
    return Weights(T, a.W1, a.b1, a.W2, a.b2, folded=True)


def load_domains(path: str | Path) -> dict[str, str]:
    """intent -> domain from a domains.json ({domain: [intent, ...]})."""
    raw = json.loads(Path(path).read_text())
    return {intent: domain for domain, intents in raw.items() for intent in intents}
