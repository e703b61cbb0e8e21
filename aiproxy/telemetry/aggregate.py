"""Worker metrics summed by the supervisor into one /metrics.

A worker hands over a snapshot of its registry (families with their samples, as plain
lists). The supervisor adds the same series of all workers together, so dashboards
read the same names and labels whether one process or N serve. Counters stay
monotonic across worker restarts: when a worker exits, the counters and histograms
of its last snapshot are kept as that slot's "retired" base (gauges are dropped).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry

# [name, type, help, [[sample_name, labels, value], ...]]
Snapshot = list[list[Any]]

MONOTONIC = ("counter", "histogram", "summary")


def snapshot(registry: CollectorRegistry) -> Snapshot:
    return [[m.name, m.type, m.documentation,
             [[s.name, s.labels, s.value] for s in m.samples]]
            for m in registry.collect()]


class Family:
    __slots__ = ("type", "help", "values", "labels")

    def __init__(self, kind: str, text: str) -> None:
        self.type = kind
        self.help = text
        self.values: dict[tuple, float] = {}
        self.labels: dict[tuple, dict[str, str]] = {}

    def add(self, samples: Iterable[list[Any]]) -> None:
        values, labels = self.values, self.labels
        for name, sample_labels, value in samples:
            key = (name, *sample_labels.items())
            if key in values:
                values[key] += value
            else:
                values[key] = value
                labels[key] = sample_labels

    def samples(self) -> Iterator[list[Any]]:
        for key, value in self.values.items():
            yield [key[0], self.labels[key], value]


def merge(into: dict[str, Family], snap: Snapshot, skip: frozenset[str] = frozenset(),
          kinds: tuple[str, ...] | None = None) -> None:
    """Add `snap`'s families (all, or only those of `kinds`) into `into`."""
    for name, kind, text, samples in snap:
        if name in skip or (kinds is not None and kind not in kinds):
            continue
        family = into.get(name)
        if family is None:
            family = into[name] = Family(kind, text)
        family.add(samples)


class WorkerMetrics:
    """The metrics one worker slot has produced, across its restarts."""

    def __init__(self) -> None:
        self.live: Snapshot | None = None
        self.retired: dict[str, Family] = {}

    def retire(self) -> None:
        """The worker is gone: keep its counters, forget its gauges."""
        if self.live is not None:
            merge(self.retired, self.live, kinds=MONOTONIC)
            self.live = None

    def parts(self) -> list[Snapshot]:
        """What to add up for this slot: the retired base and the live snapshot."""
        base = [[name, f.type, f.help, list(f.samples())] for name, f in self.retired.items()]
        return [base, self.live] if self.live is not None else [base]

    def total(self, sample_name: str) -> float:
        """Sum of one sample name over all its label sets (e.g. all requests)."""
        return sum(value for part in self.parts() for _, _, _, samples in part
                   for name, _, value in samples if name == sample_name)


def to_metrics(families: dict[str, Family]) -> Iterator[Metric]:
    for name, family in families.items():
        metric = Metric(name, family.help, family.type)
        for sample_name, labels, value in family.samples():
            metric.add_sample(sample_name, labels, value)
        yield metric
