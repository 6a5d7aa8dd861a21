"""P side: one rank's sends of one request to every D rank that needs its heads.

A P rank holds the global kv heads ``own = [lo, hi)``; the D ranks that hold some of
them each post a recv for the request's wire id (D TP 1: one rank, all heads; D TP 2
under a P TP 1: two ranks, half each). An :class:`Outbound` serves them all:

- a catch-all send (``agent.send(None, wire, ids)``, or a ``send_layer`` stream) is
  matched by the first D rank whose recv arrives;
- each other D rank whose recv waits here (``agent.pending_recvs()``) gets a send of
  its own (``agent.send(peer, ...)``; a stream gets every layer written so far);
- when a send ends ``done``, the heads its D rank holds (named in its agent's name,
  :func:`.tp.heads_of_peer`) count as covered; while ``own`` is not covered and
  the lease time is not spent, a catch-all is armed again for the D ranks still to come.

It is settled -- the blocks may go back to vLLM -- once every send's lease was released
(the agent's ``on_release``: no write still reads the blocks) and either ``own`` is
covered, a send failed (D fails or recomputes the request; nobody else will read), it was
cancelled, or ``lease_timeout`` passed since the first send. Everything runs on the
worker's thread; the agent's callbacks only queue.
"""
from __future__ import annotations

import logging
import time

from .tp import covers, heads_of_peer

log = logging.getLogger("vllm.kvxfer")


class Outbound:
    def __init__(self, spec, own: tuple, num_kv_heads: int, lease_timeout: float) -> None:
        self.request_id = spec.request_id
        self.wire = spec.wire
        self.ids = list(spec.block_ids)
        self.own = own
        self.num_kv_heads = num_kv_heads
        self.streaming = spec.streaming
        self.layers: list = []  # written so far (a stream)
        self.complete = not spec.streaming  # every layer written
        self.deadline = time.monotonic() + lease_timeout
        self.active: dict = {}  # peer name (None: the catch-all) -> handle
        self._peers: dict = {}  # peer name -> Peer its send goes to (None: the catch-all)
        self.served: set = set()  # D agents that got (or are getting) a send
        self.covered: list = []  # heads of the D ranks whose send ended done
        self.leases = 0  # sends whose lease the agent has not released yet
        self.failed = False
        self.cancelled = False
        self.ended: list = []  # handles that ended done, for the worker's counters

    # ---- what the worker calls ----------------------------------------------------------
    def start(self, agent) -> None:
        """A whole request (not a stream): the catch-all send."""
        self._arm(agent)

    def add_layer(self, agent, layer: int) -> None:
        """A stream: layer ``layer`` is written (``save_kv_layer``); ship it to every D rank."""
        self.layers.append(layer)
        if self.cancelled or self.failed:
            return
        if None not in self.active and not self.served:
            self._open(agent, None, None)  # the catch-all stream; send_layer(layer 0) opens it
            return
        for name, handle in list(self.active.items()):
            if not handle.done():
                self._call(lambda peer=self._peers.get(name): agent.send_layer(peer, self.wire, layer, self.ids))

    def finish_layers(self) -> None:
        """The forward wrote every layer (``wait_for_save``)."""
        self.complete = True

    def poll(self, agent, posts) -> None:
        """Account ended sends, serve the D ranks whose recvs wait here (``posts``: the
        ``Peer`` of each), and arm a new catch-all while heads are still uncovered."""
        for name, handle in list(self.active.items()):
            if not handle.done():
                continue
            del self.active[name]
            if handle.state == "done":
                self.covered.append(heads_of_peer(handle.peer, self.num_kv_heads))
                self.served.add(handle.peer)
                self.ended.append(handle)
            else:
                self.failed = True  # that D rank fails or recomputes; none other will use ours
        if self.cancelled or self.failed:
            return
        for peer in posts:
            if peer.name not in self.served and peer.name not in self.active:
                self._open(agent, peer.name, peer)
        planned = self.covered + [heads_of_peer(n, self.num_kv_heads) for n in self.active if n is not None]
        if None not in self.active and self.complete and not covers(planned, *self.own) \
                and time.monotonic() < self.deadline:
            self._arm(agent)  # for the D ranks whose recvs have not arrived yet

    def cancel(self) -> None:
        """Aborted or preempted: cancel every send (their leases end soon after)."""
        self.cancelled = True
        for handle in list(self.active.values()):
            handle.cancel()

    def settled(self) -> bool:
        """No send still reads the blocks and none is still owed."""
        if self.leases > 0 or any(not h.done() for h in self.active.values()):
            return False
        if self.cancelled or self.failed:
            return True
        return self.complete and (self._covered() or time.monotonic() >= self.deadline)

    @property
    def in_flight(self) -> bool:
        return self.leases > 0 or bool(self.active)

    # ---- internals -------------------------------------------------------------------
    def _covered(self) -> bool:
        return covers(self.covered, *self.own)

    def _arm(self, agent) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return
        self._call(lambda: agent.send(None, self.wire, self.ids, lease_timeout=remaining), key=None)

    def _open(self, agent, name, peer) -> None:
        """A send to ``peer`` (None: the catch-all): the layers written so far of a stream
        still being written, else the whole request."""
        self._peers[name] = peer
        if name is not None:
            self.served.add(name)
        if self.streaming and not self.complete:
            if not self.layers:
                return  # opened by the next add_layer
            first, *rest = self.layers
            handle = self._call(lambda: agent.send_layer(peer, self.wire, first, self.ids), key=name)
            for layer in rest:
                if handle is None or handle.done():
                    break
                self._call(lambda layer=layer: agent.send_layer(peer, self.wire, layer, self.ids))
            return
        self._call(lambda: agent.send(peer, self.wire, self.ids,
                                      lease_timeout=max(self.deadline - time.monotonic(), 1e-3)), key=name)

    _NO_KEY = object()

    def _call(self, fn, key=_NO_KEY):
        """Run one agent call; a call that opens a send (``key`` given) records its
        handle and its lease. A refusal fails the request on this rank (logged)."""
        from ...errors import KVXferError

        try:
            handle = fn()
        except (KVXferError, ValueError) as exc:
            log.warning("kvxfer: send of %s failed: %s", self.wire, exc)
            self.failed = True
            return None
        if key is not Outbound._NO_KEY:
            self.active[key] = handle
            self.leases += 1
        return handle
