"""The KV handoff between the pools of a virtual cluster: decode admission, the prefill,
the transfer and its landing.

:class:`KVHandoff` is the part of :class:`kvxfer.sim.vclock.VirtualCluster` that moves a
disaggregated request from its prefill worker to its decode worker, in one of the two
orders a profile's engine names (``profile.engine["handoff"]``):

- ``reserve-first`` (kvxfer's, as :mod:`kvxfer.serving.workers.decode`): the decode
  worker admits the request from its admit queue once it has the prompt's blocks, then
  the prefill worker runs it (or, under ``config.local_prefill_tokens`` uncached tokens,
  the decode worker prefills it itself);
- ``after-prefill`` (DistServe's): the decode worker is picked once the prompt is
  prefilled and takes the KV when it has the blocks; the prefill worker holds them
  meanwhile.

The prompt's uncached blocks then go over :class:`~kvxfer.serving.simulated.link.NicQueue` pairs,
``tp`` GPUs wide: the ``node_link`` (NVLink) between workers on one node, the ``link``
across nodes. Egress on the prefill worker frees its blocks at the modelled end (after
its pool put, where it has a pool); ingress on the decode worker, booked when the send
is posted, decides when decoding starts, as ``--engine sim`` does.

The mixin reads the cluster's ``requests``, ``routing``, ``counters``, ``now``, ``at``
and calls its ``_kick``, ``_pick``, ``_publish``, ``_done``, ``_watched`` and
``_maybe_switch``.
"""
from __future__ import annotations

from ..serving.engine.runtime import finish_reason
from ..serving.engine.sequence import Sequence, SequenceStatus
from ..serving.server.dispatch import usable
from .virtual_worker import SimRequest, SimWorker


class KVHandoff:
    """Decode admission, prefill submission, the P->D send and its landing (module
    docstring); a base of :class:`kvxfer.sim.vclock.VirtualCluster`."""

    def _try_admit_remote(self, worker: SimWorker) -> None:
        """The decode worker's admit queue (as :mod:`kvxfer.serving.workers.decode`)."""
        blocks = worker.runtime.blocks
        while worker.admit_queue and blocks.can_allocate(worker.admit_queue[0]):
            seq = worker.admit_queue.popleft()
            r = self.requests[seq.request_id]
            blocks.allocate(seq)
            seq.status = SequenceStatus.PREFILLING
            r.cached_blocks = seq.num_cached_tokens // blocks.block_size
            if r.prefilled is not None:  # after-prefill handoff: its KV waited for these blocks
                self._send(r.prefill, r, *r.prefilled)
                continue
            if seq.num_prompt_tokens - seq.num_cached_tokens < self.config.local_prefill_tokens:
                worker.runtime.scheduler.add_allocated(seq)
                self.routing.release(r.rid, r.prefill.name)
                r.prefill, r.mode = None, "local"
                self.counters["local_prefill_tokens"] += 1
                self._kick(worker)
                continue
            prefill = r.prefill
            if not usable(prefill, "prefill"):  # as the dispatcher: moved or being moved since
                self.routing.release(r.rid, prefill.name)
                prefill = r.prefill = self._pick("prefill", r)
            worker.awaiting_kv[r.rid] = seq
            pseq = Sequence(r.prompt_ids, seq.params, r.rid, ints_checked=True)
            pseq.hash_chain = seq.hash_chain  # one prompt: its block hashes computed once
            self._submit_prefill(prefill, r, pseq)
        self._publish(worker)

    def _submit_prefill(self, prefill: SimWorker, r: SimRequest, pseq: Sequence) -> None:
        prefill.inflight.add(r.rid)
        prefill.seqs[r.rid] = pseq
        if prefill.pool is None:  # as PrefillWorker.on_prefill
            prefill.runtime.scheduler.add(pseq)
        else:
            prefill.pool.submit(pseq)
        self._kick(prefill)

    def _prefilled(self, worker: SimWorker, r: SimRequest, seq: Sequence, token: int) -> None:
        """Token 0 on the prefill worker: streamed at once; the prompt's uncached blocks go
        to the decode worker over the two NICs (module docstring), with the after-prefill
        handoff once a decode worker has taken them (it holds them meanwhile)."""
        worker.runtime.scheduler.running.remove(seq)
        r.token_times.append(self.now)
        self.num_waiting -= 1
        self.routing.prefilled(r.rid)
        r.prefill_hit_blocks = seq.num_cached_tokens // worker.runtime.block_size
        self._watched(r, False)
        if not self.handoff_after_prefill:
            self._send(worker, r, seq, token)
        elif seq.params.max_tokens == 1:  # finished at token 0: nothing to hand over
            worker.runtime.release(seq, "length")
            r.decode = worker
            self._done(worker, r)
            self._kick(worker)
        else:  # DistServe's global scheduler picks the decode instance now
            r.prefilled, r.decode = (seq, token), self._pick("decode", r)
            r.decode.inflight.add(r.rid)
            dseq = r.decode.seqs[r.rid] = Sequence(r.prompt_ids, seq.params, r.rid, ints_checked=True)
            dseq.hash_chain = seq.hash_chain
            r.decode.admit_queue.append(dseq)
            self._try_admit_remote(r.decode)

    def _send(self, worker: SimWorker, r: SimRequest, seq: Sequence, token: int) -> None:
        """The prompt's uncached blocks from ``worker`` to ``r.decode``: over NVLink within a
        node, the network across (module docstring)."""
        r.decode.awaiting_kv.pop(r.rid, None)
        r.prefilled = None
        num_blocks = -(-seq.num_prompt_tokens // worker.runtime.block_size) - r.cached_blocks
        nbytes = num_blocks * self.profile.block_bytes
        same_node = worker.node == r.decode.node
        _, sent_at = (worker.node_nic if same_node else worker.nic).reserve(self.now, nbytes)
        _, landed_at = (r.decode.node_nic if same_node else r.decode.nic).reserve(self.now, nbytes)
        r.kv_transfer_ms = (sent_at - self.now) * 1e3
        self.counters["kv_bytes"] += nbytes
        if worker.pool is not None:  # as PrefillWorker.tick: the put is posted after the send
            worker.pool.put(seq)
        self.at(sent_at, self._sent, worker, r, seq)
        self.at(landed_at, self._landed, r, token)

    def _sent(self, worker: SimWorker, r: SimRequest, seq: Sequence) -> None:
        if worker.pool is None or not worker.pool.release(seq):  # else once its put ended
            self._free_sent(worker, seq)
        self.routing.release(r.rid, worker.name)
        self._kick(worker)
        self._maybe_switch(worker)

    def _free_sent(self, worker: SimWorker, seq: Sequence) -> None:
        """A prefill worker's sequence whose send (and put) ended leaves it."""
        worker.runtime.release(seq, "stop")
        del worker.seqs[seq.request_id]
        worker.inflight.discard(seq.request_id)

    def _puts_done(self, worker: SimWorker) -> None:
        """A put of ``worker`` committed: the sequences that waited for it go (its loop's poll)."""
        freed = worker.pool.poll()
        for seq in freed:
            self._free_sent(worker, seq)
        if freed:
            self._kick(worker)
            self._maybe_switch(worker)

    def _landed(self, r: SimRequest, token: int) -> None:
        worker = r.decode
        seq = worker.seqs[r.rid]
        seq.num_computed_tokens = seq.num_prompt_tokens
        worker.runtime.blocks.cache_full_blocks(seq)
        self._publish(worker)
        seq.token_ids.append(token)
        seq.status = SequenceStatus.DECODING
        if finish_reason(seq, token) is not None:
            worker.runtime.release(seq, "length")
            self._done(worker, r)
            self._try_admit_remote(worker)
        else:
            worker.runtime.scheduler.add_running(seq)
        self._kick(worker)

