"""A store node's Prometheus metrics (``kvxfer store --metrics HOST:PORT``, ``GET /metrics``).

Read from :meth:`StoreNode.stats` at each scrape (no bookkeeping on the hot path), on the
node's own ``CollectorRegistry``, labelled ``node`` (its name). Counters (``_total``):
hits, misses, evictions, bad objects (checksum failures reported by readers), requests,
bad requests, authentication failures, lookups answered by the backend (other hosts).
Gauges: objects, pending reservations, spare slots held for clients, pins, bytes used,
capacity, slots used and in all, connected clients.

Per tier, labelled ``tier`` (``dram``, ``disk``): ``kvxfer_store_tier_{hits,evictions}_total``
and the gauges ``kvxfer_store_tier_{objects,bytes_used,capacity_bytes}`` (a node without a
disk tier reports zeros for it). The disk tier's own: counters
``kvxfer_store_{writeback_objects,writeback_bytes,writeback_drops,disk_promotions,disk_relinks,
disk_bad_objects,disk_full_drops,disk_errors}_total``, gauges
``kvxfer_store_{writeback_queue,writeback_queue_bytes,disk_recovered,disk_shadows}`` and
``kvxfer_store_disk_up`` (1 while the tier takes writes). The endpoint serves counts only (no
key, slot or secret); bind it where your scraper can reach it.
"""
from __future__ import annotations

COUNTERS = {
    "hits": "Keys a get found committed (and pinned for the reader).",
    "misses": "Keys a get did not find.",
    "evictions": "Objects evicted (LRU, above the high watermark).",
    "bad_objects": "Objects dropped because a reader's checksum failed.",
    "requests": "Requests served.",
    "bad_requests": "Requests refused as malformed or oversize.",
    "auth_failures": "Connections that failed the secret's challenge-response.",
    "lookups_answered_by_backend": "Lookups from other hosts answered from the key table by the node's backend.",
}
GAUGES = {
    "objects": "Committed objects.",
    "pending": "Reservations not committed yet.",
    "spares": "Spare slots reserved for clients under no key (same-host puts commit into them).",
    "pins": "Objects pinned by readers now.",
    "bytes_used": "Bytes of committed objects.",
    "capacity_bytes": "Bytes of all slots.",
    "slots_used": "Slots holding a committed or pending object, or a spare.",
    "num_slots": "Slots in all.",
    "clients": "Authenticated clients connected.",
}
TIER_COUNTERS = {
    "hits": "Keys a get found, by the tier that held them (disk: read back into DRAM first).",
    "evictions": "Objects evicted from the tier (DRAM: to disk when it has one; disk: gone).",
}
TIER_GAUGES = {
    "objects": "Objects the tier holds.",
    "bytes_used": "Bytes of the objects the tier holds.",
    "capacity_bytes": "The tier's capacity in bytes.",
}
DISK_COUNTERS = {
    "writeback_objects": "Objects written back from DRAM to disk.",
    "writeback_bytes": "Bytes written back from DRAM to disk.",
    "writeback_drops": "Objects evicted from DRAM and dropped, not written (queue full, disk unusable).",
    "disk_promotions": "Objects read back from disk into DRAM.",
    "disk_relinks": "Objects evicted from DRAM whose bytes were still on disk (nothing written).",
    "disk_bad_objects": "Objects on disk dropped because their bytes failed the read-back check.",
    "disk_full_drops": "Objects not written because the file system was full.",
    "disk_errors": "Other disk write errors.",
}
DISK_GAUGES = {
    "writeback_queue": "Objects being written back now.",
    "writeback_queue_bytes": "DRAM bytes held by writes in flight.",
    "disk_recovered": "Objects recovered from the disk tier at start.",
    "disk_shadows": "Objects read back into DRAM whose bytes stay on disk until evicted.",
}


class NodeCollector:
    """A ``prometheus_client`` collector over one node's :meth:`~StoreNode.stats`."""

    def __init__(self, node) -> None:
        self.node = node

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.node.stats()
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(f"kvxfer_store_{key}", doc, labels=["node"])
            family.add_metric([stats["name"]], float(stats[key]))
            yield family
        for key, doc in GAUGES.items():
            family = GaugeMetricFamily(f"kvxfer_store_{key}", doc, labels=["node"])
            family.add_metric([stats["name"]], float(stats[key]))
            yield family
        for table, kind in ((TIER_COUNTERS, CounterMetricFamily), (TIER_GAUGES, GaugeMetricFamily)):
            for key, doc in table.items():
                family = kind(f"kvxfer_store_tier_{key}", doc, labels=["node", "tier"])
                for tier in ("dram", "disk"):
                    family.add_metric([stats["name"], tier], float(stats.get(f"{tier}_{key}", 0)))
                yield family
        for table, kind in ((DISK_COUNTERS, CounterMetricFamily), (DISK_GAUGES, GaugeMetricFamily)):
            for key, doc in table.items():
                family = kind(f"kvxfer_store_{key}", doc, labels=["node"])
                family.add_metric([stats["name"]], float(stats.get(key, 0)))
                yield family
        family = GaugeMetricFamily("kvxfer_store_disk_up", "1 while the node's disk tier takes writes.",
                                   labels=["node"])
        family.add_metric([stats["name"]], float(stats.get("disk_state") == "ok"))
        yield family


def serve_metrics(node, listen: str):
    """Serve ``node``'s metrics at ``http://listen/metrics`` on a daemon thread; returns
    ``(http server, its port)``: ``server.shutdown()`` stops it."""
    from prometheus_client import CollectorRegistry, start_http_server

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--metrics must be HOST:PORT (port 0: any free port), got {listen!r}")
    registry = CollectorRegistry()
    registry.register(NodeCollector(node))
    server, _ = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    return server, server.server_address[1]
