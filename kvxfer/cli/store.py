"""``kvxfer store``: one node of the KV pool (``kvxfer.KVStore`` clients use it).

``kvxfer store --listen 10.0.0.5:7600 --capacity 64G --discovery etcd://10.0.0.2:2379``
allocates ``--capacity`` of host memory, registers it once (objects of every size share
it in size classes; ``--slot-size`` is the largest object: one block, every layer and kv
head, of the largest model you pool), listens on ``--listen`` and publishes itself
under a lease (``--ttl``; under ``{prefix}/store``). The shared secret comes from
``KVXFER_SECRET`` or ``--secret-file`` (never the command line, never etcd). It serves
until SIGTERM or Ctrl-C, then withdraws from discovery and exits. Objects are not
persisted: a restarted node starts empty. ``--metrics HOST:PORT`` serves Prometheus
metrics (:mod:`kvxfer.store.metrics`) at ``/metrics``.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from kvxfer.bench.transfer import parse_size


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="one node of the KV-cache pool (kvxfer.KVStore)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="port 0: any free port")
    p.add_argument("--capacity", required=True, type=parse_size, metavar="SIZE", help="e.g. 64G, 512M")
    p.add_argument("--slot-size", type=parse_size, default=2 << 20, metavar="SIZE",
                   help="the largest object the node holds (default 2M); smaller objects share the "
                        "capacity in size classes")
    p.add_argument("--high-watermark", type=float, default=0.98, metavar="F",
                   help="fraction of slots in use above which LRU objects are evicted")
    p.add_argument("--lease", type=float, default=30.0, metavar="S",
                   help="how long a reservation or a reader's pin may stay open")
    p.add_argument("--discovery", default=None, metavar="URL", help="etcd://HOST:PORT[/prefix]")
    p.add_argument("--replicas", type=int, default=1, metavar="K",
                   help="replicas clients should write (published for them; KVStore(replicas=K) applies it)")
    p.add_argument("--ttl", type=float, default=5.0, metavar="S", help="discovery lease")
    p.add_argument("--name", default=None)
    p.add_argument("--secret-file", default=None, metavar="PATH")
    p.add_argument("--backend", default="auto", choices=("auto", "ucx", "vm"))
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvxfer.secrets import load_secret
    from kvxfer.store.node import StoreNode

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("kvxfer.store")
    try:
        secret = load_secret(args.secret_file, remove=True)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"kvxfer store: {exc}") from None
    if args.replicas < 1:
        raise SystemExit("kvxfer store: --replicas must be >= 1")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        node = StoreNode(args.listen, args.capacity, secret=secret, slot_bytes=args.slot_size,
                         high_watermark=args.high_watermark, lease_s=args.lease, backend=args.backend,
                         name=args.name)
    except (ValueError, TypeError, OSError) as exc:
        raise SystemExit(f"kvxfer store: {exc}") from None
    reg = disc = metrics = None
    try:
        if args.metrics:
            from kvxfer.store.metrics import serve_metrics

            try:
                metrics, mport = serve_metrics(node, args.metrics)
            except (ValueError, OSError) as exc:
                raise SystemExit(f"kvxfer store: --metrics: {exc}") from None
        if args.discovery:
            from kvxfer.discovery import Member
            from kvxfer.store.members import open_store_discovery

            disc = open_store_discovery(args.discovery)
            st = node.index.stats()
            reg = disc.publish(Member(name=node.name.replace("/", "_"), role="store", address=node.address,
                                      info={"capacity_bytes": st["capacity_bytes"], "slot_bytes": st["slot_bytes"],
                                            "replicas": args.replicas}), ttl_s=args.ttl)
        log.info("store node %s listening on %s: %d slots of %d B", node.name, node.address,
                 node.index.num_slots, node.index.slot_bytes)
        print(f"kvxfer store listening on {node.address}", flush=True)
        if metrics is not None:
            print(f"kvxfer store metrics on http://{args.metrics.rpartition(':')[0]}:{mport}/metrics", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        if metrics is not None:
            metrics.shutdown()
        if reg is not None:
            reg.close()
        if disc is not None:
            disc.close()
        node.close()
    return 0
