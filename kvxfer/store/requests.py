"""What a store node does for each request: the handlers :class:`~kvxfer.store.node.StoreNode`
dispatches through (:data:`HANDLERS`, one per kind of :class:`~kvxfer.store.protocol.Req`).

A handler is ``handler(node, client, request id, fields, now) -> reply``: the reply's dict,
None for RELEASE (which has none), or :data:`DEFERRED` for a GET whose reply waits for the
disk tier's reads (:func:`get_reply` answers it once they ended). Handlers run on the node's
I/O thread, over its index (:mod:`kvxfer.store.index`), tiers (:mod:`kvxfer.store.tiers`) and
quotas (:mod:`kvxfer.store.quotas`); the fields were validated by
:func:`~kvxfer.store.protocol.parse_request`. What a node holds it checks here against what the
client claims: an object's size against its format (:func:`~kvxfer.store.protocol.format_nbytes`),
its checksum against ``require_checksums``.
"""
from __future__ import annotations

from .protocol import NO_CRC, REFUSED, Req, format_nbytes

__all__ = ["HANDLERS", "DEFERRED", "MAX_REPLY_PARTS", "get_reply"]

# checksums one GET reply may carry (one per object put whole, one per part of the others):
# 4,096 keys with 16,384 part checksums stay well inside a 1 MiB reply frame
MAX_REPLY_PARTS = 16384
DEFERRED = object()  # a request whose reply comes later (a GET waiting for its disk reads)


def on_lookup(node, c, rid: int, f: dict, now: float) -> dict:
    return {"id": rid, "present": "".join("1" if node.tiers.contains(k) else "0" for k in f["keys"])}


def on_reserve(node, c, rid: int, f: dict, now: float) -> dict:
    """RESERVE, and RESERVE_PART (``heads`` among the fields)."""
    idx = node.index
    if f["nbytes"] > idx.slot_bytes:
        return _too_large(node, rid, f["nbytes"])
    if (bad := _bad_size(node, rid, f)) is not None:
        return bad
    out = []
    for k in f["keys"]:
        if "heads" not in f:
            code, obj = idx.reserve(k, f["nbytes"], f["fmt"], c.owner, now, node.lease_s)
            token = obj.token if obj is not None else 0
        else:
            code, obj, part = idx.reserve_part(k, f["nbytes"], f["fmt"], *f["heads"], c.owner, now, node.lease_s)
            token = part.token if part is not None else 0
        out.append([code, obj.offset, token] if obj is not None else [code, 0, 0])
    return {"id": rid, "r": out}


def on_spare(node, c, rid: int, f: dict, now: float) -> dict:
    if f["nbytes"] > node.index.slot_bytes:
        return _too_large(node, rid, f["nbytes"])
    # a spare never costs an object (free chunks only, whatever "evict" asks) and
    # lapses soon unless used: spares are for clients that are putting
    lease = min(node.lease_s, node.quotas.spare_lease_s)
    out = []
    for _ in range(f["count"]):
        _, obj = node.index.reserve_spare(c.owner, now, lease, evict=False, nbytes=f["nbytes"])
        if obj is None:
            break
        out.append([obj.offset, obj.token])
    return {"id": rid, "s": out, "lease_s": lease}


def on_commit_spare(node, c, rid: int, f: dict, now: float) -> dict:
    if f["nbytes"] > node.index.slot_bytes:
        return _too_large(node, rid, f["nbytes"])
    if (bad := _bad_size(node, rid, f)) is not None:
        return bad
    return {"id": rid, "r": [REFUSED if t and _refuse_crc(node, crc) else
                             node.index.commit_spare(k, t, f["nbytes"], f["fmt"], crc, c.owner, now)
                             for k, t, crc in zip(f["keys"], f["tokens"], f["crcs"])]}


def on_commit(node, c, rid: int, f: dict, now: float) -> dict:
    ok = []
    for k, t, crc in zip(f["keys"], f["tokens"], f["crcs"]):
        if _refuse_crc(node, crc):  # against this node's policy: the reservation is given up
            node.index.abort(k, t, c.owner)
            ok.append(False)
        else:
            ok.append(node.index.commit(k, t, crc, c.owner))
    return {"id": rid, "ok": ok}


def on_abort(node, c, rid: int, f: dict, now: float) -> dict:
    for k, t in zip(f["keys"], f["tokens"]):
        node.index.abort(k, t, c.owner)
    return {"id": rid}


def on_get(node, c, rid: int, f: dict, now: float):
    pending = node.tiers.start_get(c, rid, f, now)
    if pending is None:
        return get_reply(node, c, rid, f, now, ())
    c.waiting = pending
    node.waiting_gets.append(pending)
    return DEFERRED


def on_release(node, c, rid: int, f: dict, now: float) -> None:
    bad = set(f["bad"])
    for pin in f["pins"]:
        node.index.release(pin, c.owner, bad=pin in bad)


def on_stats(node, c, rid: int, f: dict, now: float) -> dict:
    return {"id": rid, **node.stats()}


def get_reply(node, c, rid: int, f: dict, now: float, promoted) -> dict:
    """A GET's reply: each key pinned (in DRAM by now) or missed; ``disk``: how many of
    its hits were read back from the disk tier for it (``promoted``)."""
    idx = node.index
    out, budget, from_disk = [], MAX_REPLY_PARTS, 0
    for k in f["keys"]:
        if not idx.contains(k):
            node.tiers.rescue(k)  # evicted while the reply waited: still in its chunk
        # the reply must fit a frame: objects whose part checksums would overflow it miss
        seen = idx.peek(k)
        budget -= len(seen.crc) if seen is not None and isinstance(seen.crc, list) else 1
        if budget < 0:
            idx.misses += 1
            out.append([0, 0, 0, 0])
            continue
        obj, pin = idx.get(k, f["fmt"], c.owner, now, node.lease_s, nbytes=format_nbytes(f["fmt"]))
        out.append([obj.offset, obj.nbytes, obj.crc, pin] if obj is not None else [0, 0, 0, 0])
        from_disk += obj is not None and k in promoted
    node.tiers.disk_hits += from_disk
    return {"id": rid, "r": out, "disk": from_disk}


def _bad_size(node, rid: int, f: dict) -> dict | None:
    """The error reply for a request whose ``nbytes`` is not the size its ``fmt`` names
    (None: they agree). A client's ``nbytes`` is never taken on its word: an object held
    at another size than its format's would fail every reader."""
    want = format_nbytes(f["fmt"])
    if want == f["nbytes"]:
        return None
    node.num_bad_requests += 1
    return {"id": rid, "error": "bad_request",
            "reason": f"nbytes {f['nbytes']} is not the size format {f['fmt'][:64]!r} names ({want})"}


def _refuse_crc(node, crc: int) -> bool:
    """A commit without a checksum (``NO_CRC``) on a node that requires them."""
    return node.require_checksums and crc == NO_CRC


def _too_large(node, rid: int, nbytes: int) -> dict:
    node.num_bad_requests += 1
    return {"id": rid, "error": "too_large",
            "reason": f"an object of {nbytes} B exceeds the largest this node holds ({node.index.slot_bytes} B)"}


# request kind -> its handler
HANDLERS = {Req.LOOKUP: on_lookup, Req.RESERVE: on_reserve, Req.RESERVE_PART: on_reserve, Req.SPARE: on_spare,
            Req.COMMIT_SPARE: on_commit_spare, Req.COMMIT: on_commit, Req.ABORT: on_abort, Req.GET: on_get,
            Req.RELEASE: on_release, Req.STATS: on_stats}
if set(HANDLERS) != set(Req):
    raise ImportError("a store request kind has no handler")
