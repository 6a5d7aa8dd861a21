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
from dataclasses import dataclass

from ..errors import LimitExceeded

MAX_POSTS_PER_PEER = 16384  # unmatched RECV_POSTs cached per peer (oldest dropped)
MAX_POSTED_BLOCKS_PER_PEER = 1 << 20  # block ids across those posts (oldest dropped)
MAX_TOMBSTONES_PER_PEER = 4096  # request ids a peer ended before we sent them (oldest dropped)
MAX_NOTIFY_BYTES = 1 << 20  # one NOTIFY payload
MAX_NOTES_PER_PEER = 1024  # notifications queued and not yet drained, per peer
MAX_NOTE_BYTES_PER_PEER = 16 << 20  # their bytes
MAX_STAGE_REQS_PER_PEER = 16  # staging requests waiting or granted and not yet used, per peer


@dataclass(frozen=True)
class PeerLimits:
    """The bounds above, as one frozen value (``AgentConfig.limits``)."""

    max_posts: int = MAX_POSTS_PER_PEER
    max_posted_blocks: int = MAX_POSTED_BLOCKS_PER_PEER
    max_tombstones: int = MAX_TOMBSTONES_PER_PEER
    max_notify_bytes: int = MAX_NOTIFY_BYTES
    max_notes: int = MAX_NOTES_PER_PEER
    max_note_bytes: int = MAX_NOTE_BYTES_PER_PEER
    max_stage_reqs: int = MAX_STAGE_REQS_PER_PEER

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"PeerLimits.{name} must be an int >= 1, got {value!r}")


class PeerBook:
    """Counters and bounded caches of one peer (guarded by the agent state's lock)."""

    def __init__(self, limits: PeerLimits = PeerLimits()) -> None:
        self.limits = limits
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
        while self.posts and (len(self.posts) >= self.limits.max_posts
                              or self.posted_blocks + num_blocks > self.limits.max_posted_blocks):
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
        while len(self.tombstones) > self.limits.max_tombstones:
            self.tombstones.popitem(last=False)

    # ---- notifications (D side) ----------------------------------------------------------
    def add_note(self, nbytes: int) -> None:
        lim = self.limits
        if nbytes > lim.max_notify_bytes:
            raise LimitExceeded(f"NOTIFY of {nbytes} B exceeds {lim.max_notify_bytes} B")
        if self.notes >= lim.max_notes or self.note_bytes + nbytes > lim.max_note_bytes:
            raise LimitExceeded(f"{self.notes} notifications ({self.note_bytes} B) from this peer are "
                                f"not drained yet (limits {lim.max_notes}, {lim.max_note_bytes} B)")
        self.notes += 1
        self.note_bytes += nbytes

    def drain_note(self, nbytes: int) -> None:
        self.notes -= 1
        self.note_bytes -= nbytes

    # ---- staging requests (D side) -------------------------------------------------------
    def add_stage_req(self) -> None:
        if self.stage_reqs >= self.limits.max_stage_reqs:
            raise LimitExceeded(f"more than {self.limits.max_stage_reqs} staging requests outstanding")
        self.stage_reqs += 1

    def end_stage_req(self) -> None:
        self.stage_reqs -= 1
