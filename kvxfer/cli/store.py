"""``kvxfer store``: one node of the KV pool (``kvxfer.KVStore`` clients use it).

``kvxfer store --listen 10.0.0.5:7600 --capacity 64G --discovery etcd://10.0.0.2:2379``
allocates ``--capacity`` of host memory, registers it once (objects of every size share
it in size classes; ``--slot-size`` is the largest object: one block, every layer and kv
head, of the largest model you pool), listens on ``--listen`` and publishes itself
under a lease (``--ttl``; under ``{prefix}/store``). The shared secret comes from
``KVXFER_SECRET`` or ``--secret-file`` (never the command line, never etcd). It serves
until SIGTERM or Ctrl-C, then withdraws from discovery and exits. ``--metrics HOST:PORT``
serves Prometheus metrics (:mod:`kvxfer.store.metrics`) at ``/metrics``.

``--disk PATH --disk-capacity SIZE`` adds a disk tier (:mod:`kvxfer.store.disk`): objects
DRAM evicts are written there (write-back, bounded by ``--writeback-queue``), gets read
them back, and a node restarted on the same PATH serves what it held. SIGTERM first
writes DRAM's objects to disk (for up to ``--flush-timeout`` seconds). Without ``--disk``
nothing is persisted: a restarted node starts empty.
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
    p.add_argument("--disk", default=None, metavar="PATH",
                   help="a directory for the disk tier (created if absent; one node per directory)")
    p.add_argument("--disk-capacity", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of the disk tier's data file (with --disk; e.g. 1T, 200G)")
    p.add_argument("--disk-threads", type=int, default=8, metavar="N", help="disk I/O threads (default 8)")
    p.add_argument("--disk-sync", choices=("none", "commit"), default="none",
                   help="commit: fdatasync an object's data and its journal record before it counts as written "
                        "(survives power loss); none (default): a killed node loses nothing written, a host's "
                        "power loss may lose the last records")
    p.add_argument("--no-direct-io", action="store_true", help="buffered disk I/O even where O_DIRECT works")
    p.add_argument("--writeback-queue", type=parse_size, default=None, metavar="SIZE",
                   help="DRAM chunks write-back may hold at once; twice this is kept free (default: 1/16 of "
                        "--capacity, at most 512M)")
    p.add_argument("--disk-get-wait", type=float, default=1.0, metavar="S",
                   help="how long a get's reply waits for objects read back from disk; later ones miss (default 1; "
                        "keep it under the clients' timeout)")
    p.add_argument("--flush-timeout", type=float, default=30.0, metavar="S",
                   help="at SIGTERM, seconds to spend writing DRAM's objects to disk (default 30; 0: none)")
    p.add_argument("--require-checksums", action="store_true",
                   help="refuse objects put without a checksum (clients with checksum=False cannot put)")
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
    disk = None
    if (args.disk is None) != (args.disk_capacity is None):
        raise SystemExit("kvxfer store: --disk and --disk-capacity go together")
    if args.disk is not None:
        from kvxfer.store.disk import DiskConfig

        try:
            disk = DiskConfig(args.disk, args.disk_capacity, threads=args.disk_threads, sync=args.disk_sync == "commit",
                              direct=not args.no_direct_io, queue_bytes=args.writeback_queue,
                              flush_s=args.flush_timeout, promote_timeout_s=args.disk_get_wait)
        except ValueError as exc:
            raise SystemExit(f"kvxfer store: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        node = StoreNode(args.listen, args.capacity, secret=secret, slot_bytes=args.slot_size,
                         high_watermark=args.high_watermark, lease_s=args.lease, backend=args.backend,
                         name=args.name, disk=disk, require_checksums=args.require_checksums)
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
        st = node.stats()
        if disk is not None:  # what the disk tier holds (recovered), or why there is none
            print(f"kvxfer store disk tier {disk.path}: " + (
                f"{st['disk_recovered']} objects ({st['disk_recovered_bytes'] / 1e6:.1f} MB) recovered in "
                f"{st['disk_recovery_s']:.3f} s, {st['disk_capacity_bytes'] / 1e9:.2f} GB, "
                f"{'O_DIRECT' if st['disk_direct'] else 'buffered I/O'}" if st["disk_state"] == "ok"
                else f"unavailable ({st.get('disk_error') or st['disk_state']}): serving DRAM only"), flush=True)
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
