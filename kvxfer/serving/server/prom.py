"""The router's Prometheus metrics, on ``prometheus_client``.

Each router owns one :class:`Registry`, over its own ``CollectorRegistry`` (never
the process-global one, so several servers can run in one process, as tests do).
Workers report their own counters (the agents' bytes, transfers, failures), which
the router sets as gauges labelled by worker (and drops when a worker stops reporting
them: a role change, a worker gone). A metric's label names are declared
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

    def remove(self, **labels: str) -> None:
        """Drop the series of ``labels`` (none there: nothing to do)."""
        if labels.keys() != set(self._labels):
            raise ValueError(f"metric labels are {self._labels}, got {sorted(labels)}")
        try:
            self._metric.remove(*(labels[k] for k in self._labels))
        except KeyError:
            pass


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


class WorkerSeries:
    """The series the router keeps for each worker: ``kvxfer_worker_up``,
    ``kvxfer_worker_inflight``, the counters and gauges it reports
    (``kvxfer_worker_stat{worker,stat}``) and its agent's facts
    (``kvxfer_agent_info{worker,key,value}``).

    What a worker stops reporting (a gauge of the role it left, a transport it no longer
    uses) is dropped at its next report, and a worker gone from the cluster loses every
    series it had, so the families hold the present workers' series only."""

    def __init__(self, registry: Registry) -> None:
        self.up = registry.gauge("kvxfer_worker_up", "1 if the worker process is alive.", ("worker",))
        self.inflight = registry.gauge("kvxfer_worker_inflight", "Requests held by each worker (queue depth).",
                                       ("worker",))
        self.stat = registry.gauge("kvxfer_worker_stat", "Counters reported by each worker and its agent.",
                                   ("worker", "stat"))
        self.info = registry.gauge("kvxfer_agent_info", "Agent facts: backend, transport selected per peer.",
                                   ("worker", "key", "value"))
        self._reported: dict[str, tuple[set, set]] = {}  # worker -> (stats, info (key, value))

    def seen(self, name: str, alive: bool, load: int) -> None:
        """Worker ``name`` is in the cluster: its liveness and queue depth."""
        self.up.set(1 if alive else 0, worker=name)
        self.inflight.set(load, worker=name)
        self._reported.setdefault(name, (set(), set()))

    def report(self, name: str, counters: dict, info: dict) -> None:
        """Worker ``name``'s report (``{stat: number}``, ``{key: value}``): these are its
        stat and info series from now on."""
        facts = {(key, str(value)) for key, value in info.items()}
        for key, value in counters.items():
            self.stat.set(value, worker=name, stat=key)
        for key, value in facts:
            self.info.set(1, worker=name, key=key, value=value)
        self._forget(name, set(counters), facts)

    def keep(self, names) -> None:
        """Drop every series of the workers not in ``names`` (gone from the cluster)."""
        names = set(names)
        for name in [n for n in self._reported if n not in names]:
            self._forget(name, set(), set())
            self.up.remove(worker=name)
            self.inflight.remove(worker=name)
            del self._reported[name]

    def _forget(self, name: str, stats: set, facts: set) -> None:
        old_stats, old_facts = self._reported.get(name, (set(), set()))
        for key in old_stats - stats:
            self.stat.remove(worker=name, stat=key)
        for key, value in old_facts - facts:
            self.info.remove(worker=name, key=key, value=value)
        self._reported[name] = (stats, facts)
