"""The router's own light metric families: a counter, gauge or histogram with label names and
one series per label values, updated on the event loop without a lock (a histogram observation
is a ``bisect`` and two adds) and exposed through ``prometheus_client``'s collector interface, so
the exposition is the standard one. Used by :mod:`router.observe.metrics`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = ["Family"]


class _Value:
    """One counter or gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Buckets:
    """One histogram series: per-bucket counts (not cumulative until exposed) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket ``le``: value <= bound
        self.sum += value


class Family(Collector):
    """A metric with label names and one series per label values; unlabeled families are used
    directly (``observe``, ``inc``, ``set``). Registered on the app's registry."""

    def __init__(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: Iterable[str] = (),
        *,
        registry: CollectorRegistry,
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind, self.name, self.doc = kind, name, doc
        self.labelnames = list(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._one = self.labels()
        registry.register(self)

    def labels(self, *values: Any) -> Any:
        key = tuple(map(str, values))
        s = self._series.get(key)
        if s is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            s = self._series[key] = _Buckets(self.bounds) if self.kind == "histogram" else _Value()
        return s

    def remove(self, *values: Any) -> None:
        self._series.pop(tuple(map(str, values)), None)

    def observe(self, value: float) -> None:
        self._one.observe(value)

    def inc(self, amount: float = 1.0) -> None:
        self._one.inc(amount)

    def set(self, value: float) -> None:
        self._one.set(value)

    def describe(self) -> Iterator[Metric]:
        yield from self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        ln = self.labelnames
        m: Any
        if self.kind == "histogram":
            m = HistogramMetricFamily(self.name, self.doc, labels=ln)
        elif self.kind == "counter":
            m = CounterMetricFamily(self.name, self.doc, labels=ln)
        else:
            m = GaugeMetricFamily(self.name, self.doc, labels=ln)
        for key, s in list(self._series.items()) if with_samples else ():
            if self.kind != "histogram":
                m.add_metric(list(key), s.value)
                continue
            acc, cum = 0, []
            for bound, n in zip((*self.bounds, float("inf")), s.counts):
                acc += n
                cum.append((_bound_text(bound), float(acc)))
            m.add_metric(list(key), cum, s.sum)
        yield m


def _bound_text(b: float) -> str:
    """As prometheus_client writes ``le``: ``+Inf``, else the float's repr (``0.005``, ``1.0``)."""
    return "+Inf" if b == float("inf") else repr(float(b))
