"""Bounds on what connected peers can make this agent hold: per peer and per agent.

Every queue or cache a peer fills is counted against that peer (:class:`PeerBook`,
one per :class:`~kvxfer.control.peers.Peer`) and against the agent's total over
all its peers (:class:`AgentBook`), so a peer that floods fails itself, and many
connections together still cannot exhaust the agent. Caches of hints (unmatched
RECV_POSTs, tombstones of ended requests) drop their oldest entry when full -- at
an agent-wide bound, the oldest entry of the peer holding the most; queues of work
(notifications, staging requests) close the connection of the peer whose message
would exceed a bound with :class:`~kvxfer.errors.LimitExceeded`. A peer's caches
are emptied when it disconnects. The numbers are documented in ``docs/api.md``
("Limits").
"""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass

from ..errors import LimitExceeded

MAX_POSTS_PER_PEER = 16384  # unmatched RECV_POSTs cached per peer (oldest dropped)
MAX_POSTED_BLOCKS_PER_PEER = 1 << 20  # block ids across those posts (oldest dropped)
MAX_TOMBSTONES_PER_PEER = 4096  # request ids a peer ended before we sent them (oldest dropped)
MAX_TOMBSTONE_BYTES_PER_PEER = 1 << 20  # their bytes (TOMBSTONE_OVERHEAD + id + reason each)
MAX_NOTIFY_BYTES = 1 << 20  # one NOTIFY payload
MAX_NOTES_PER_PEER = 1024  # notifications queued and not yet drained, per peer
MAX_NOTE_BYTES_PER_PEER = 16 << 20  # their bytes
MAX_STAGE_REQS_PER_PEER = 16  # staging requests waiting or granted and not yet used, per peer

# totals over all peers of one agent
MAX_POSTS_PER_AGENT = 65536
MAX_POSTED_BLOCKS_PER_AGENT = 4 << 20
MAX_TOMBSTONES_PER_AGENT = 16384
MAX_TOMBSTONE_BYTES_PER_AGENT = 8 << 20
MAX_NOTES_PER_AGENT = 4096
MAX_NOTE_BYTES_PER_AGENT = 64 << 20
MAX_STAGE_REQS_PER_AGENT = 1024

# what a tombstone costs besides the characters of its request id and reason: the
# two str headers, the (xid, code, reason, nbytes) tuple, its ints and the table slot
TOMBSTONE_OVERHEAD = 256


@dataclass(frozen=True)
class PeerLimits:
    """The bounds above, as one frozen value (``AgentConfig.limits``): the ``max_*`` fields
    bound each peer, the ``max_agent_*`` fields the sum over all peers of the agent."""

    max_posts: int = MAX_POSTS_PER_PEER
    max_posted_blocks: int = MAX_POSTED_BLOCKS_PER_PEER
    max_tombstones: int = MAX_TOMBSTONES_PER_PEER
    max_tombstone_bytes: int = MAX_TOMBSTONE_BYTES_PER_PEER
    max_notify_bytes: int = MAX_NOTIFY_BYTES
    max_notes: int = MAX_NOTES_PER_PEER
    max_note_bytes: int = MAX_NOTE_BYTES_PER_PEER
    max_stage_reqs: int = MAX_STAGE_REQS_PER_PEER
    max_agent_posts: int = MAX_POSTS_PER_AGENT
    max_agent_posted_blocks: int = MAX_POSTED_BLOCKS_PER_AGENT
    max_agent_tombstones: int = MAX_TOMBSTONES_PER_AGENT
    max_agent_tombstone_bytes: int = MAX_TOMBSTONE_BYTES_PER_AGENT
    max_agent_notes: int = MAX_NOTES_PER_AGENT
    max_agent_note_bytes: int = MAX_NOTE_BYTES_PER_AGENT
    max_agent_stage_reqs: int = MAX_STAGE_REQS_PER_AGENT

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"PeerLimits.{name} must be an int >= 1, got {value!r}")


def tombstone_nbytes(req: str, reason: str) -> int:
    """The bytes a tombstone of ``req`` with ``reason`` is counted as."""
    return TOMBSTONE_OVERHEAD + sys.getsizeof(req) + sys.getsizeof(reason)


class _Counts:
    """What a book holds: cached posts and their block ids, tombstones and their bytes,
    undrained notifications and their bytes, outstanding staging requests."""

    def __init__(self) -> None:
        self.num_posts = 0
        self.posted_blocks = 0
        self.num_tombstones = 0
        self.tombstone_bytes = 0
        self.notes = 0
        self.note_bytes = 0
        self.stage_reqs = 0


class AgentBook(_Counts):
    """The totals over every connected peer's book, and those books (guarded by the
    agent state's lock, like every book)."""

    def __init__(self, limits: PeerLimits = PeerLimits()) -> None:
        super().__init__()
        self.limits = limits
        self.books: dict = {}  # peer serial -> PeerBook, of connected peers

    def open(self, serial: int) -> "PeerBook":
        """The book of a new peer (lock held)."""
        book = PeerBook(self, serial)
        self.books[serial] = book
        return book

    def _largest(self, attr: str) -> "PeerBook":
        return max(self.books.values(), key=lambda b: getattr(b, attr))


class PeerBook(_Counts):
    """Counters and bounded caches of one peer, counted in its :class:`AgentBook` too
    (guarded by the agent state's lock). Tombstones keep only what a later send of
    that id needs: ``(xid, code, reason)`` -- a FAIL code (None: cancelled) and at
    most 200 characters of text; never an exception or a block list."""

    MAX_REASON = 200

    def __init__(self, agent: AgentBook | None = None, serial: int = 0) -> None:
        super().__init__()
        self.agent = agent if agent is not None else AgentBook()
        self.limits = self.agent.limits
        self.serial = serial
        self.is_open = True
        self.posts: collections.OrderedDict = collections.OrderedDict()  # req -> num blocks, oldest first
        self.tombstones: collections.OrderedDict = collections.OrderedDict()  # req -> (xid, code, reason, nbytes)

    # ---- unmatched RECV_POSTs (P side) ---------------------------------------------------
    def add_post(self, req: str, num_blocks: int) -> list:
        """Count a cached post; return ``[(peer serial, request id), ...]`` of the older
        posts dropped to make room (of this peer, or of the largest at an agent bound)."""
        self.drop_post(req)
        lim, agent = self.limits, self.agent
        dropped = []
        while self.posts and (self.num_posts >= lim.max_posts
                              or self.posted_blocks + num_blocks > lim.max_posted_blocks):
            dropped.append((self.serial, self._pop_post()))
        while agent.num_posts and agent.num_posts >= lim.max_agent_posts:
            victim = agent._largest("num_posts")
            dropped.append((victim.serial, victim._pop_post()))
        while agent.num_posts and agent.posted_blocks + num_blocks > lim.max_agent_posted_blocks:
            victim = agent._largest("posted_blocks")
            dropped.append((victim.serial, victim._pop_post()))
        self.posts[req] = num_blocks
        self._count_post(1, num_blocks)
        return dropped

    def drop_post(self, req: str) -> None:
        n = self.posts.pop(req, None)
        if n is not None:
            self._count_post(-1, -n)

    def _pop_post(self) -> str:
        req, n = self.posts.popitem(last=False)
        self._count_post(-1, -n)
        return req

    def _count_post(self, posts: int, blocks: int) -> None:
        self.num_posts += posts
        self.posted_blocks += blocks
        if self.is_open:
            self.agent.num_posts += posts
            self.agent.posted_blocks += blocks

    # ---- tombstones (P side) -------------------------------------------------------------
    def bury(self, req: str, xid: int, code: str | None, reason: str) -> None:
        """Remember that the peer ended ``req`` (its attempt ``xid``): with the FAIL ``code``
        (None: cancelled) and ``reason``, for a send of that id that comes later."""
        if not self.is_open:
            return
        self.unbury(req)
        reason = str(reason)[:self.MAX_REASON]
        nbytes = tombstone_nbytes(req, reason)
        self.tombstones[req] = (xid, code, reason, nbytes)
        self._count_tombstone(1, nbytes)
        lim, agent = self.limits, self.agent
        while self.tombstones and (self.num_tombstones > lim.max_tombstones
                                   or self.tombstone_bytes > lim.max_tombstone_bytes):
            self._pop_tombstone()
        while agent.num_tombstones and (agent.num_tombstones > lim.max_agent_tombstones
                                        or agent.tombstone_bytes > lim.max_agent_tombstone_bytes):
            agent._largest("tombstone_bytes")._pop_tombstone()

    def unbury(self, req: str) -> tuple | None:
        """Remove the tombstone of ``req``; its ``(xid, code, reason)``, or None."""
        tomb = self.tombstones.pop(req, None)
        if tomb is None:
            return None
        self._count_tombstone(-1, -tomb[3])
        return tomb[:3]

    def buried_xid(self, req: str) -> int | None:
        """The attempt of ``req`` a tombstone remembers, or None."""
        tomb = self.tombstones.get(req)
        return None if tomb is None else tomb[0]

    def _pop_tombstone(self) -> None:
        _, tomb = self.tombstones.popitem(last=False)
        self._count_tombstone(-1, -tomb[3])

    def _count_tombstone(self, num: int, nbytes: int) -> None:
        self.num_tombstones += num
        self.tombstone_bytes += nbytes
        if self.is_open:
            self.agent.num_tombstones += num
            self.agent.tombstone_bytes += nbytes

    # ---- notifications (D side) ----------------------------------------------------------
    def add_note(self, nbytes: int) -> None:
        lim, agent = self.limits, self.agent
        if nbytes > lim.max_notify_bytes:
            raise LimitExceeded(f"NOTIFY of {nbytes} B exceeds {lim.max_notify_bytes} B")
        if self.notes >= lim.max_notes or self.note_bytes + nbytes > lim.max_note_bytes:
            raise LimitExceeded(f"{self.notes} notifications ({self.note_bytes} B) from this peer are "
                                f"not drained yet (limits {lim.max_notes}, {lim.max_note_bytes} B)")
        if agent.notes >= lim.max_agent_notes or agent.note_bytes + nbytes > lim.max_agent_note_bytes:
            raise LimitExceeded(f"{agent.notes} notifications ({agent.note_bytes} B) from all peers are "
                                f"not drained yet (agent limits {lim.max_agent_notes}, "
                                f"{lim.max_agent_note_bytes} B)")
        self._count_note(1, nbytes)

    def drain_note(self, nbytes: int) -> None:
        self._count_note(-1, -nbytes)

    def _count_note(self, num: int, nbytes: int) -> None:
        # queued notifications stay counted in the agent after the peer left, until drained
        self.notes += num
        self.note_bytes += nbytes
        self.agent.notes += num
        self.agent.note_bytes += nbytes

    # ---- staging requests (D side) -------------------------------------------------------
    def add_stage_req(self) -> None:
        lim = self.limits
        if self.stage_reqs >= lim.max_stage_reqs:
            raise LimitExceeded(f"more than {lim.max_stage_reqs} staging requests outstanding")
        if self.agent.stage_reqs >= lim.max_agent_stage_reqs:
            raise LimitExceeded(f"more than {lim.max_agent_stage_reqs} staging requests outstanding "
                                "from all peers")
        self._count_stage_req(1)

    def end_stage_req(self) -> None:
        self._count_stage_req(-1)

    def _count_stage_req(self, num: int) -> None:
        self.stage_reqs += num
        if self.is_open:
            self.agent.stage_reqs += num

    # ---- disconnect ----------------------------------------------------------------------
    def close(self) -> None:
        """The peer disconnected (lock held): drop its caches and stop counting its
        staging requests in the agent (their grants are freed without a word from it).
        Its undrained notifications stay counted until drained."""
        if not self.is_open:
            return
        self.posts.clear()
        self.tombstones.clear()
        agent = self.agent
        agent.num_posts -= self.num_posts
        agent.posted_blocks -= self.posted_blocks
        agent.num_tombstones -= self.num_tombstones
        agent.tombstone_bytes -= self.tombstone_bytes
        agent.stage_reqs -= self.stage_reqs
        self.num_posts = self.posted_blocks = self.num_tombstones = self.tombstone_bytes = 0
        self.is_open = False
        agent.books.pop(self.serial, None)
