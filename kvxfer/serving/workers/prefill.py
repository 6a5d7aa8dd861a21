"""Prefill worker: compute prompts, sample token 0, push KV to a decode worker.

Per request: allocate blocks (reusing this worker's own prefix cache), run
the prompt in chunks of at most ``max_num_batched_tokens``, sample token 0 and
report it at once (the client's TTFT), then ``agent.send`` the blocks the
decode worker lacks (``block_table[skip_blocks:]``; its recv is already
posted, so the write starts at once) and report ``sent`` with the handle's
send -> done time as soon as it completes. The blocks are held
until the send completes, fails, or outlives its lease
(``--transfer-timeout``), then freed; full blocks keep their prefix hash.

With a KV pool (``--store``, :class:`~kvxfer.serving.workers.pool.PrefillPool`), a new
prompt waits in the pool's queue until the scheduler would take it, then loads its pool
hits before it is scheduled; its computed full blocks are put into the pool after its
prefill, posted after the send so that the decode worker's KV is first on the wire
(async; the blocks are freed once both the send and the put ended).

Simulated engine (``runtime.nic`` set, :mod:`kvxfer.serving.simulated.link`): the write is
posted at once; the transfer is booked on this worker's modelled egress, its
blocks are freed at the modelled end (never before the real write is done),
and ``sent`` reports the modelled time (egress queueing included).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from ...errors import KVXferError, PeerDisconnected
from ..engine.sequence import Sequence
from .loop import WorkerLoop, token_event
from ..engine.runtime import sampling_params

log = logging.getLogger("kvxfer.worker")


@dataclass
class Outgoing:
    seq: Sequence
    handle: object  # kvxfer.TransferHandle
    posted_at: float
    settle_at: float = 0.0  # simulated engine: the modelled end of the transfer


class PrefillWorker(WorkerLoop):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.jobs: dict[str, dict] = {}  # rid -> prefill message, until token 0
        self.seqs: dict[str, Sequence] = {}
        self.outgoing: dict[str, Outgoing] = {}
        self.peers = ctx.peers  # decode agent address -> kvxfer.Peer (kept across role switches)
        self.pool = ctx.pool  # PrefillPool or None
        self.counters.update(sends_ok=0, sends_failed=0, leases_expired=0, kv_bytes_sent=0)

    def on_prefill(self, msg: dict) -> None:
        seq = Sequence(msg["prompt_ids"], sampling_params(msg["params"]), msg["rid"])
        self.jobs[seq.request_id] = msg
        self.seqs[seq.request_id] = seq
        if self.pool is None:
            self.runtime.scheduler.add(seq)
        else:
            self.pool.submit(seq)

    def on_abort(self, msg: dict) -> None:
        rid = msg["rid"]
        self.jobs.pop(rid, None)
        if rid in self.outgoing:
            return  # the decode side waits on it; the lease bounds how long we hold it
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            if self.pool is not None:
                self.pool.forget(seq)
            self.runtime.release(seq)

    def has_work(self) -> bool:
        return bool(self.seqs) or (self.pool is not None and self.pool.busy)

    def is_busy(self) -> bool:
        return self.runtime.scheduler.has_work()

    def tick(self) -> None:
        self._poll_sends()
        if self.pool is not None:
            for seq in self.pool.poll():  # their puts ended: the blocks may go
                self.runtime.release(seq, "stop")
            self.pool.admit_queued()
        step = self.step()
        for (seq, token), logprobs in zip(step.produced, step.logprobs):
            rid = seq.request_id
            # Prefill is all this worker does: the sequence leaves the batch
            # but keeps its blocks until the send settles.
            self.runtime.scheduler.running.remove(seq)
            msg = self.jobs.pop(rid, None)
            if msg is None:  # aborted mid-prefill
                self.seqs.pop(rid, None)
                if self.pool is not None:
                    self.pool.forget(seq)
                self.runtime.release(seq)
                continue
            self.send(token_event(rid, token, logprobs))
            self._post_send(seq, msg)
            if self.pool is not None:  # after the send: the decode worker's KV goes first
                if rid in self.outgoing:
                    self.pool.put(seq)
                else:  # the send failed at once: its blocks are gone already
                    self.pool.forget(seq)

    def _peer(self, address: str):
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = self.agent.connect(address)
        return peer

    def _post_send(self, seq: Sequence, msg: dict) -> None:
        rid = seq.request_id
        block_ids = seq.block_table[int(msg.get("skip_blocks", 0)):]
        nic, ready_at, settle_at = self.runtime.nic, time.perf_counter(), 0.0
        if nic is not None:
            _, settle_at = nic.reserve(ready_at, self.runtime.transfer_bytes(len(block_ids)))
        try:
            handle = self.agent.send(self._peer(msg["dst"]), rid, block_ids)
        except KVXferError as exc:
            if isinstance(exc, PeerDisconnected):
                self.peers.pop(msg["dst"], None)
            self._settle(seq, f"{type(exc).__name__}: {exc}")
            return
        self.outgoing[rid] = Outgoing(seq, handle, time.perf_counter(), settle_at)
        handle.add_done_callback(functools.partial(self._report_sent, rid,
                                                   (settle_at - ready_at) * 1e3 if nic else None))

    def _report_sent(self, rid: str, modelled_ms: float | None, handle) -> None:
        """Done callback, on the agent's thread: ``sent`` goes out as soon as the data
        landed, even while the main loop is inside a seconds-long prefill step (the
        channel's send is one short locked ``sendall``). Failures and expiry are the
        main loop's (:meth:`_poll_sends`)."""
        if handle.state != "done":
            return
        self.send({"ev": "sent", "rid": rid, "kv_bytes": handle.nbytes,
                   "transfer_ms": modelled_ms if modelled_ms is not None
                   else (handle.finished - handle.created) * 1e3})

    def _poll_sends(self) -> None:
        now = time.perf_counter()
        for rid, out in list(self.outgoing.items()):
            if not out.handle.done():
                if now - out.posted_at > self.ctx.transfer_timeout_s:
                    out.handle.cancel()  # lease expired: the decode side has given up
                    self.counters["leases_expired"] += 1
                    self._settle(out.seq, "lease expired", out)
                continue
            if out.handle.state == "done":
                if now < out.settle_at:
                    continue  # simulated: the modelled transfer is still on the wire
                self._settle(out.seq, None, out)
            else:
                error = out.handle.error
                self._settle(out.seq, f"{type(error).__name__}: {error}", out)

    def _settle(self, seq: Sequence, error: str | None, out: Outgoing | None = None) -> None:
        rid = seq.request_id
        self.outgoing.pop(rid, None)
        self.seqs.pop(rid, None)
        if self.pool is None or not self.pool.release(seq):
            self.runtime.release(seq, "stop")
        if error is None:  # "sent" went out from _report_sent already
            self.counters["sends_ok"] += 1
            self.counters["kv_bytes_sent"] += out.handle.nbytes
        else:
            self.counters["sends_failed"] += 1
            log.warning("%s: KV send failed: %s", rid, error)
            self.send({"ev": "send_failed", "rid": rid, "error": error})

    def stats(self) -> dict:
        sched = self.runtime.scheduler
        return {"waiting": len(sched.waiting) + (len(self.pool.queue) if self.pool is not None else 0),
                "running": len(sched.running),
                "sending": len(self.outgoing), "free_blocks": self.runtime.blocks.num_free_blocks,
                **(self.pool.counters if self.pool is not None else {})}
