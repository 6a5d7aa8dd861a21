"""A minimal Prometheus text-format registry (counters, gauges, histograms).

The router owns one :class:`Registry`; workers report their own counters
(the agents' bytes, transfers, failures) which the router renders as gauges
labelled by worker. Text format 0.0.4, no client library needed.
"""
from __future__ import annotations

import bisect
import math

# seconds; TTFT and end-to-end latency
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# seconds; time per output token and KV transfer time
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    parts = []
    for key, value in sorted(labels.items()):
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{key}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Counter:
    """A counter family: one value per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, /, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        if not self.values:
            lines.append(f"{self.name} 0")
        for key, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(dict(key))} {_num(value)}")
        return lines


class Gauge(Counter):
    kind = "gauge"


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, object] = {}

    def _add(self, metric):
        self._metrics[metric.name] = metric
        return metric

    def histogram(self, name: str, help_text: str, buckets=LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, buckets))

    def counter(self, name: str, help_text: str) -> Counter:
        return self._add(Counter(name, help_text))

    def gauge(self, name: str, help_text: str) -> Gauge:
        return self._add(Gauge(name, help_text))

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
