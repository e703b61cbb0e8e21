"""`aiproxy router train|eval|classify`: train, evaluate and try intent models."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _count(least: int):
    """An argparse type: an integer of at least `least` (a bad value is an argument
    error, exit 2, not quietly read as another)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value
    return parse


def _share(text: str) -> float:
    """An argparse type: a probability in [0, 1) (dropout, label smoothing): 1 or more
    would zero, or divide by zero, every input."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value < 1:  # also nan
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from aiproxy.semantic.train import TrainConfig

    d = TrainConfig()
    p = argparse.ArgumentParser(prog="aiproxy router",
                                description="Train, evaluate and try semantic-routing models.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    t = sub.add_parser("train", help="train an intent model (numpy) and write it as ONNX",
                       description="Train a hashed n-gram embedding-bag + MLP intent classifier "
                       "on JSON-lines data and write a self-describing ONNX model.")
    t.add_argument("--data", action="append", required=True, metavar="FILE.jsonl",
                   help="training rows (repeatable)")
    t.add_argument("--val", action="append", default=[], metavar="FILE.jsonl",
                   help="validation rows (repeatable): picks the oos threshold, reported")
    t.add_argument("--text-field", default="text")
    t.add_argument("--label-field", default="intent")
    t.add_argument("--domain-field", default="domain",
                   help="row field naming the label's domain, when rows have it (domain)")
    t.add_argument("--domains", metavar="FILE.json",
                   help="{domain: [label, ...]} map (overrides --domain-field)")
    t.add_argument("--oos-label", default=d.oos_label)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--buckets", type=int, default=d.buckets)
    t.add_argument("--dim", type=_count(1), default=d.dim)
    t.add_argument("--hidden", type=_count(0), default=d.hidden, help="hidden units (0: none)")
    t.add_argument("--epochs", type=_count(1), default=d.epochs)
    t.add_argument("--batch", type=_count(1), default=d.batch)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--lr-embed", type=float, default=d.lr_embed)
    t.add_argument("--lr-decay", type=float, default=d.lr_decay)
    t.add_argument("--dropout", type=_share, default=d.dropout)
    t.add_argument("--hidden-dropout", type=_share, default=d.hidden_dropout)
    t.add_argument("--feature-dropout", type=_share, default=d.feature_dropout)
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--label-smoothing", type=_share, default=d.label_smoothing)
    t.add_argument("--output-bias", action=argparse.BooleanOptionalAction,
                   default=d.output_bias,
                   help="give the output layer a bias (off: one graph node less)")
    t.add_argument("--average-from", type=_count(0), default=d.average_from, metavar="EPOCH",
                   help="ship the mean of the weights after each epoch from EPOCH on (0: last)")
    t.add_argument("--ensemble", type=_count(1), default=d.ensemble, metavar="K",
                   help="train K members from different seeds; the model averages their "
                   "logits in one graph (K times the table width)")
    t.add_argument("--jobs", type=_count(1), default=1, metavar="N",
                   help="train ensemble members in N processes (same weights, less wall time)")
    t.add_argument("--fold", action=argparse.BooleanOptionalAction, default=d.fold,
                   help="without a hidden layer, ship the table times the output layer "
                   "(one table of per-class logits: no output MatMul at run time)")
    t.add_argument("--word-ngrams", type=int, default=d.word_ngrams, choices=(1, 2, 3))
    t.add_argument("--char-ngrams", default=f"{d.char_min},{d.char_max}", metavar="MIN,MAX",
                   help="character n-gram lengths (0,0: none)")
    t.add_argument("--pooling", default=d.pooling, choices=("mean", "sqrt"))
    t.add_argument("--word-vectors", default=d.word_vectors, metavar="NAME",
                   help="frozen pretrained word vectors as a second input (glove-6b-50d, "
                   "from the train extra); the model keeps a vocabulary and no vectors")
    t.add_argument("--vocab-top", type=_count(0), default=d.vocab_top, metavar="N",
                   help="with --word-vectors: the vocabulary also has the N most frequent "
                   "words, besides those of the training rows")
    t.add_argument("--vocab-scale", type=float, default=d.vocab_scale,
                   help="with --word-vectors: multiply the vectors by this")
    t.add_argument("--vocab-dropout", type=_share, default=d.vocab_dropout,
                   help="with --word-vectors: leave a training text's word vectors out "
                   "with this probability (the n-grams learn to stand alone)")
    t.add_argument("--word-vector-members", type=_count(0), default=d.word_vector_members,
                   metavar="K", help="with --word-vectors: train the --ensemble members "
                   "without them and K more with them, and add only the word rows of the "
                   "latter (times --word-vector-weight) to the former's table")
    t.add_argument("--word-vector-weight", type=float, default=d.word_vector_weight,
                   help="with --word-vector-members: weight of their word rows (0.5)")
    t.add_argument("--threshold-target", type=float, default=d.threshold_target,
                   help="oos recall on --val the threshold is chosen for")
    t.add_argument("--threshold", type=float, help="fixed confidence threshold (no search)")
    t.add_argument("--dtype", default=d.dtype, choices=("int8", "float16", "float32"),
                   help="embedding table type in the ONNX file")
    t.add_argument("-o", "--output", required=True, metavar="MODEL.onnx")
    t.add_argument("-q", "--quiet", action="store_true")

    e = sub.add_parser("eval", help="evaluate a model: one JSON object on stdout",
                       description="Accuracy (in-scope), macro F1, oos recall/precision, "
                       "single-request latency and batched throughput.")
    e.add_argument("-m", "--model", required=True, help="MODEL.onnx or builtin:NAME")
    e.add_argument("--data", action="append", required=True, metavar="FILE.jsonl")
    e.add_argument("--text-field", default="text")
    e.add_argument("--label-field", default="intent")
    e.add_argument("--oos-label", default=None, help="label of out-of-scope rows "
                   "(default: the model's)")
    e.add_argument("--threshold", type=float, help="override the model's threshold")
    e.add_argument("--batch", type=_count(1), default=32,
                   help="batch size for throughput (32)")
    e.add_argument("--latency-rows", type=_count(0), default=0,
                   help="time single requests on this many rows (0: all)")

    c = sub.add_parser("classify", help="classify one text",
                       description="Print label, confidence, domain and the top 3. A text "
                       "without a letter or digit is not classified (the proxy routes such a "
                       "request without an intent): an error, exit 2.")
    c.add_argument("-m", "--model", default="builtin:clinc150")
    c.add_argument("--json", action="store_true", help="one JSON object instead of text")
    c.add_argument("text", nargs="+")
    return p


def main(argv: list[str] | None = None) -> int:
    # Training is many small matrix products: a BLAS thread pool only adds contention and
    # makes sums run in a different order each time. Takes effect when numpy is not
    # imported yet, as from `aiproxy router`.
    if "numpy" not in sys.modules:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    args = _parser().parse_args(argv)
    from aiproxy.semantic.classifier import ModelError

    try:
        if args.cmd == "train":
            return _train(args)
        if args.cmd == "eval":
            return _eval(args)
        return _classify(args)
    except ModelError as exc:
        print(f"aiproxy router: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"aiproxy router: {exc}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from aiproxy.semantic import export
    from aiproxy.semantic.train import TrainConfig, load_domains, load_jsonl, train

    try:
        cmin, cmax = (int(x) for x in args.char_ngrams.split(","))
    except ValueError:
        raise ValueError(f"--char-ngrams wants MIN,MAX, not {args.char_ngrams!r}") from None
    cfg = TrainConfig(
        buckets=args.buckets, seed=args.seed, word_ngrams=args.word_ngrams, char_min=cmin,
        char_max=cmax, pooling=args.pooling, dim=args.dim, hidden=args.hidden,
        epochs=args.epochs, batch=args.batch, lr=args.lr, lr_embed=args.lr_embed,
        lr_decay=args.lr_decay, dropout=args.dropout, hidden_dropout=args.hidden_dropout,
        feature_dropout=args.feature_dropout, weight_decay=args.weight_decay,
        label_smoothing=args.label_smoothing, average_from=args.average_from,
        output_bias=args.output_bias, ensemble=args.ensemble, fold=args.fold,
        oos_label=args.oos_label, word_vectors=args.word_vectors, vocab_top=args.vocab_top,
        vocab_scale=args.vocab_scale, vocab_dropout=args.vocab_dropout,
        word_vector_members=args.word_vector_members,
        word_vector_weight=args.word_vector_weight,
        threshold_target=args.threshold_target, dtype=args.dtype)
    data = load_jsonl(args.data, args.text_field, args.label_field, args.domain_field)
    if not data.texts:
        raise ValueError("no training rows")
    val = load_jsonl(args.val, args.text_field, args.label_field, None) if args.val else None
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    trained = train(cfg, data, val, log=log, jobs=args.jobs)
    if args.threshold is not None:
        trained.threshold = args.threshold
    domains = load_domains(args.domains) if args.domains else data.domains
    path = export.save(trained, args.output, domains)
    summary = {"model": str(path), "bytes": path.stat().st_size, "classes": len(trained.classes),
               "rows": len(data.texts), "threshold": trained.threshold,
               "val": trained.val_metrics, "train_seconds": trained.meta["train_seconds"]}
    print(json.dumps(summary))
    return 0


def _eval(args) -> int:
    import numpy as np

    from aiproxy.semantic.classifier import IntentModel
    from aiproxy.semantic.train import load_jsonl, metrics

    model = IntentModel(args.model, threshold=args.threshold)
    oos = args.oos_label or model.oos_label
    data = load_jsonl(args.data, args.text_field, args.label_field, None)
    if not data.texts:
        raise ValueError("no rows to evaluate")
    texts = data.texts
    bs = args.batch
    pred: list[str] = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), bs):
        pred += [d.label for d in model.classify_batch(texts[i:i + bs])]
    batch_secs = time.perf_counter() - t0
    result = {"model": model.spec}
    result.update(metrics(pred, data.labels, oos))
    result["threshold"] = model.threshold
    rows = texts if args.latency_rows == 0 else texts[:args.latency_rows]
    for text in rows[:200]:  # warm caches
        model.classify(text)
    times = np.empty(len(rows), np.float64)
    cpu = np.empty(len(rows), np.float64)
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    classify = model.classify
    for i, text in enumerate(rows):
        c = cpu_clock()
        t = clock()
        classify(text)
        times[i] = clock() - t
        cpu[i] = cpu_clock() - c
    # wall clock per request; cpu_p50 is this thread's CPU time per request, which a busy
    # shared machine does not inflate (it includes the clock call, under a microsecond)
    result["latency_us"] = {"p50": round(float(np.percentile(times, 50)) / 1e3, 2),
                            "p99": round(float(np.percentile(times, 99)) / 1e3, 2),
                            "cpu_p50": round(float(np.percentile(cpu, 50)) / 1e3, 2),
                            "rows": len(rows)}
    result["throughput"] = {"batch": bs, "requests_per_s": round(len(texts) / batch_secs)}
    print(json.dumps(result))
    return 0


def _classify(args) -> int:
    from aiproxy.semantic.classifier import IntentModel
    from aiproxy.semantic.router import has_words

    text = " ".join(args.text)
    if not has_words(text):
        # What a model says about a text without a word is no reading of it (the shipped
        # one: "calculator" at 0.92); the proxy gives such a request no intent.
        raise ValueError("no text to classify: it has no letter or digit "
                         "(the proxy routes such a request without an intent)")
    model = IntentModel(args.model)
    d = model.classify(text)
    if args.json:
        print(json.dumps(d.as_dict()))
        return 0
    print(f"label: {d.label}")
    print(f"confidence: {d.confidence:.4f}")
    print(f"domain: {d.domain}")
    print("top:")
    for lab, p in d.top:
        print(f"  {lab}\t{p:.4f}")
    return 0
