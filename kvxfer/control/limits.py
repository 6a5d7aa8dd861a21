"""Per-peer bounds: what one connected peer can make this agent hold.

Every queue or cache a peer fills is counted against that peer alone
(:class:`PeerBook`, one per :class:`~kvxfer.control.peers.Peer`), so a peer
that floods fails itself -- never another peer. Caches of hints (unmatched
RECV_POSTs, tombstones of cancelled requests) drop their oldest entry when full;
queues of work (notifications, staging requests) close the flooding peer's
connection with :class:`~kvxfer.errors.LimitExceeded`. The numbers are
documented in ``docs/api.md`` ("Limits").
"""
from __future__ import annotations

import collections

from ..errors import LimitExceeded

MAX_POSTS_PER_PEER = 16384  # unmatched RECV_POSTs cached per peer (oldest dropped)
MAX_POSTED_BLOCKS_PER_PEER = 1 << 20  # block ids across those posts (oldest dropped)
MAX_TOMBSTONES_PER_PEER = 4096  # request ids a peer ended before we sent them (oldest dropped)
MAX_NOTIFY_BYTES = 1 << 20  # one NOTIFY payload
MAX_NOTES_PER_PEER = 1024  # notifications queued and not yet drained, per peer
MAX_NOTE_BYTES_PER_PEER = 16 << 20  # their bytes
MAX_STAGE_REQS_PER_PEER = 16  # staging requests waiting or granted and not yet used, per peer


class PeerBook:
    """Counters and bounded caches of one peer (guarded by the agent's lock)."""

    def __init__(self) -> None:
        self.posts: collections.OrderedDict = collections.OrderedDict()  # req -> blocks, oldest first
        self.posted_blocks = 0
        self.tombstones: collections.OrderedDict = collections.OrderedDict()  # req -> (xid, error)
        self.notes = 0
        self.note_bytes = 0
        self.stage_reqs = 0

    # ---- unmatched RECV_POSTs (P side) ---------------------------------------------------
    def add_post(self, req: str, num_blocks: int) -> list:
        """Count a cached post; return the request ids of older posts dropped to make room."""
        self.drop_post(req)
        dropped = []
        while self.posts and (len(self.posts) >= MAX_POSTS_PER_PEER
                              or self.posted_blocks + num_blocks > MAX_POSTED_BLOCKS_PER_PEER):
            old, n = self.posts.popitem(last=False)
            self.posted_blocks -= n
            dropped.append(old)
        self.posts[req] = num_blocks
        self.posted_blocks += num_blocks
        return dropped

    def drop_post(self, req: str) -> None:
        n = self.posts.pop(req, None)
        if n is not None:
            self.posted_blocks -= n

    # ---- tombstones (P side) -------------------------------------------------------------
    def bury(self, req: str, xid: int, error) -> None:
        self.tombstones.pop(req, None)
        self.tombstones[req] = (xid, error)
        while len(self.tombstones) > MAX_TOMBSTONES_PER_PEER:
            self.tombstones.popitem(last=False)

    # ---- notifications (D side) ----------------------------------------------------------
    def add_note(self, nbytes: int) -> None:
        if nbytes > MAX_NOTIFY_BYTES:
            raise LimitExceeded(f"NOTIFY of {nbytes} B exceeds {MAX_NOTIFY_BYTES} B")
        if self.notes >= MAX_NOTES_PER_PEER or self.note_bytes + nbytes > MAX_NOTE_BYTES_PER_PEER:
            raise LimitExceeded(f"{self.notes} notifications ({self.note_bytes} B) from this peer are "
                                f"not drained yet (limits {MAX_NOTES_PER_PEER}, {MAX_NOTE_BYTES_PER_PEER} B)")
        self.notes += 1
        self.note_bytes += nbytes

    def drain_note(self, nbytes: int) -> None:
        self.notes -= 1
        self.note_bytes -= nbytes

    # ---- staging requests (D side) -------------------------------------------------------
    def add_stage_req(self) -> None:
        if self.stage_reqs >= MAX_STAGE_REQS_PER_PEER:
            raise LimitExceeded(f"more than {MAX_STAGE_REQS_PER_PEER} staging requests outstanding")
        self.stage_reqs += 1

    def end_stage_req(self) -> None:
        self.stage_reqs -= 1
