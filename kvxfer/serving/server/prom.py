"""The router's Prometheus metrics, on ``prometheus_client``.

Each router owns one :class:`Registry`, over its own ``CollectorRegistry`` (never
the process-global one, so several servers can run in one process, as tests do).
Workers report their own counters (the agents' bytes, transfers, failures), which
the router sets as gauges labelled by worker. A metric's label names are declared
when it is made; every update gives exactly those labels.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as _Counter, Gauge as _Gauge, Histogram as _Histogram

# seconds; TTFT and end-to-end latency
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# seconds; time per output token and KV transfer time
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Family:
    def __init__(self, metric, labels: tuple[str, ...]):
        self._metric, self._labels = metric, labels

    def _child(self, labels: dict[str, str]):
        if labels.keys() != set(self._labels):
            raise ValueError(f"metric labels are {self._labels}, got {sorted(labels)}")
        return self._metric.labels(**labels) if self._labels else self._metric


class Counter(_Family):
    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        self._child(labels).inc(amount)


class Gauge(_Family):
    def set(self, value: float, /, **labels: str) -> None:
        self._child(labels).set(value)


class Registry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def histogram(self, name: str, help_text: str, buckets=LATENCY_BUCKETS) -> _Histogram:
        return _Histogram(name, help_text, buckets=buckets, registry=self.registry)

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        labels = tuple(sorted(labels))
        return Counter(_Counter(name, help_text, labels, registry=self.registry), labels)

    def gauge(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Gauge:
        labels = tuple(sorted(labels))
        return Gauge(_Gauge(name, help_text, labels, registry=self.registry), labels)

    def render(self) -> str:
        """Text exposition format 0.0.4."""
        return generate_latest(self.registry).decode()
