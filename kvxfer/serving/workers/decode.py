"""Decode worker (and colocated worker): continuous batching over one KV pool.

A ``remote`` request's blocks are reserved at admission (prefix-cached ones
reused) and the missing ones posted to :meth:`kvxfer.Agent.recv` at once, so
the prefill worker's send finds them and writes without a round trip. Its
first token comes from the prefill worker (relayed by the router); from then
on the transfer has ``--transfer-timeout`` to land. Once both are in, the
sequence joins the running batch. A ``local`` request (colocated mode, a
recompute, or a prefill the router keeps off a long prefill queue) is
prefilled here, and so is a ``remote`` one whose admit message carries
``local_below`` when its uncached prompt (after this worker's prefix-cache
hits) is shorter than that: it answers ``admitted`` with ``local: true`` and
the router sends no prefill (conditional disaggregation).

Block safety: blocks of a recv that ended without its data (cancelled,
failed, timed out) stay held by a placeholder until the agent releases the
recv's lease (``on_release``: no peer can still write into them), so a late
one-sided write never lands in another request's KV.

Simulated engine (``runtime.nic`` set, :mod:`kvxfer.sim`): every received
block is checked against the content the prefill worker's simulated forward
wrote (a mismatch is a failed transfer), and the KV counts as landed when
this worker's modelled ingress has carried the real model's bytes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...errors import KVXferError
from ..engine.sequence import Sequence, SequenceStatus
from .loop import WorkerLoop, token_event
from ..engine.runtime import finish_reason, sampling_params

log = logging.getLogger("kvxfer.worker")


@dataclass
class RemoteJob:
    """A request whose prompt KV is coming from a prefill worker."""

    seq: Sequence
    handle: object | None = None  # kvxfer.TransferHandle of the recv, posted at token 0
    first_token: int | None = None
    token_at: float = 0.0  # time.monotonic() when token 0 arrived: the send is under way
    is_kv_ready: bool = False
    is_released: bool = False  # the agent released the recv's lease
    skip_blocks: int = 0  # prefix blocks this worker had cached: not received
    landed_at: float | None = None  # simulated engine: modelled end of the ingress (perf_counter)


class DecodeWorker(WorkerLoop):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.seqs: dict[str, Sequence] = {}  # every request this worker holds
        self.remote: dict[str, RemoteJob] = {}  # waiting for KV and/or token 0
        self.admit_queue: list[dict] = []  # remote admits waiting for free blocks
        self.quarantine: dict[str, Sequence] = {}  # placeholders holding blocks of dead recvs
        self.counters.update(recv_ok=0, recv_failed=0, recomputed=0, kv_bytes_received=0,
                             local_prefills=0)
        if self.runtime.nic is not None:
            self.counters.update(kv_verified=0, kv_mismatched=0)

    # ---- messages ---------------------------------------------------------
    def on_admit(self, msg: dict) -> None:
        seq = Sequence(msg["prompt_ids"], sampling_params(msg["params"]), msg["rid"])
        self.seqs[seq.request_id] = seq
        if msg.get("mode") == "local":
            self.runtime.scheduler.add(seq)
        else:
            self.admit_queue.append(msg)

    def _try_admit_remote(self) -> None:
        blocks = self.runtime.blocks
        while self.admit_queue:
            rid = self.admit_queue[0]["rid"]
            seq = self.seqs.get(rid)
            if seq is None:  # aborted while queued
                self.admit_queue.pop(0)
                continue
            if not blocks.can_allocate(seq):
                return
            msg = self.admit_queue.pop(0)
            blocks.allocate(seq)
            seq.status = SequenceStatus.PREFILLING
            skip = seq.num_cached_tokens // self.runtime.block_size
            uncached = seq.num_prompt_tokens - seq.num_cached_tokens
            if uncached < int(msg.get("local_below", 0)):
                # conditional disaggregation: a short uncached prompt is cheaper
                # to prefill here than to queue, compute and ship elsewhere
                self.runtime.scheduler.add_allocated(seq)
                self.counters["local_prefills"] += 1
                self.send({"ev": "admitted", "rid": rid, "cached_blocks": skip, "local": True})
                continue
            job = self.remote[rid] = RemoteJob(seq, skip_blocks=skip)
            # The agent's timeout is only a backstop: the prefill queue ahead of
            # this request is unbounded; _poll_transfers times the transfer itself.
            try:
                job.handle = self.agent.recv(rid, seq.block_table[skip:],
                                             timeout=self.ctx.request_timeout_s)
            except KVXferError as exc:
                self._transfer_failed(job, f"recv: {exc}")
            self.send({"ev": "admitted", "rid": rid, "cached_blocks": skip})

    def on_first_token(self, msg: dict) -> None:
        job = self.remote.get(msg["rid"])
        if job is not None and job.first_token is None:
            job.first_token = int(msg["token"])
            job.token_at = time.monotonic()

    def on_transfer_failed(self, msg: dict) -> None:
        job = self.remote.get(msg["rid"])
        if job is None or job.is_kv_ready:
            return
        self._retire_recv(job)
        self._transfer_failed(job, msg.get("error", "transfer failed"))

    def on_abort(self, msg: dict) -> None:
        rid = msg["rid"]
        job = self.remote.get(rid)
        if job is not None:
            self._retire_recv(job)
        self._drop(rid, "abort")

    # ---- transfers --------------------------------------------------------
    def _retire_recv(self, job: RemoteJob) -> None:
        """End ``job``'s recv without its data; its blocks wait for the lease release."""
        handle, job.handle = job.handle, None
        if handle is None or handle.state == "done":
            return
        handle.cancel()  # no-op when it already failed
        if job.is_released:
            return
        seq = job.seq
        holder = Sequence(seq.token_ids[:1], request_id=f"{seq.request_id}#quarantine")
        holder.block_table, seq.block_table, seq.block_hashes = seq.block_table, [], []
        seq.num_cached_tokens = seq.num_computed_tokens = 0
        self.quarantine[seq.request_id] = holder

    def _drain_releases(self) -> None:
        released = self.ctx.released
        while released is not None and not released.empty():
            rid = released.get_nowait()
            holder = self.quarantine.pop(rid, None)
            if holder is not None:
                self.runtime.blocks.deallocate(holder)
            elif rid in self.remote:
                self.remote[rid].is_released = True

    def _poll_transfers(self) -> None:
        self._drain_releases()
        for rid, job in list(self.remote.items()):
            if job.handle is not None and job.handle.done() and not job.is_kv_ready:
                handle = job.handle
                if handle.state == "done" and self.runtime.nic is not None \
                        and not self._landed(job):
                    continue
                if handle.state == "done":
                    job.is_kv_ready = True
                    self.counters["recv_ok"] += 1
                    self.counters["kv_bytes_received"] += handle.nbytes
                    self.send({"ev": "kv", "rid": rid, "recomputed": False,
                               "kv_bytes": handle.nbytes})
                else:
                    error = handle.error
                    self._retire_recv(job)
                    self._transfer_failed(job, f"{type(error).__name__}: {error}")
                    continue
            elif (job.first_token is not None and not job.is_kv_ready and job.handle is not None
                  and time.monotonic() - job.token_at > self.ctx.transfer_timeout_s):
                self._retire_recv(job)
                self._transfer_failed(job, f"no KV {self.ctx.transfer_timeout_s:.0f}s after token 0")
                continue
            if job.is_kv_ready and job.first_token is not None:
                self._start_decoding(job)

    def _landed(self, job: RemoteJob) -> bool:
        """Simulated engine: verify the received bytes once, then wait for the modelled
        ingress; False while the transfer is still on the modelled wire (or failed)."""
        seq, runtime = job.seq, self.runtime
        if job.landed_at is None:
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            if not runtime.pool.verify(prompt, seq.block_table, job.skip_blocks):
                self.counters["kv_mismatched"] += 1
                self._retire_recv(job)
                self._transfer_failed(job, "received KV does not match what was sent")
                return False
            self.counters["kv_verified"] += 1
            num_blocks = len(seq.block_table) - job.skip_blocks
            _, job.landed_at = runtime.nic.reserve(time.perf_counter(),
                                                   runtime.transfer_bytes(num_blocks))
        return time.perf_counter() >= job.landed_at

    def _transfer_failed(self, job: RemoteJob, error: str) -> None:
        rid = job.seq.request_id
        self.counters["recv_failed"] += 1
        if self.ctx.on_transfer_failure != "recompute":
            self._drop(rid, "abort")
            self.send({"ev": "error", "rid": rid, "kind": "transfer_failed",
                       "error": f"KV transfer failed: {error}"})
            return
        # Recompute: prefill the prompt here. Token 0, if the client already has
        # it, joins the prompt, so the next sampled token is token 1.
        log.warning("%s: KV transfer failed (%s); recomputing the prompt", rid, error)
        del self.remote[rid]
        seq = job.seq
        self.runtime.blocks.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.counters["recomputed"] += 1
        self.send({"ev": "kv", "rid": rid, "recomputed": True, "kv_bytes": 0})
        if job.first_token is not None:
            seq.token_ids.append(job.first_token)
            reason = finish_reason(seq, job.first_token)
            if reason is not None:  # token 0 was the whole answer
                self._finish(seq, reason)
                return
        self.runtime.scheduler.add(seq)

    def _start_decoding(self, job: RemoteJob) -> None:
        seq = job.seq
        del self.remote[seq.request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.runtime.blocks.cache_full_blocks(seq)  # the received prefix is reusable now
        seq.token_ids.append(job.first_token)
        seq.status = SequenceStatus.DECODING
        reason = finish_reason(seq, job.first_token)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self.runtime.scheduler.add_running(seq)

    # ---- the loop ---------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.seqs or self.quarantine)

    def is_busy(self) -> bool:
        return self.runtime.scheduler.has_work()

    def tick(self) -> None:
        self._try_admit_remote()
        self._poll_transfers()
        step = self.step()
        for (seq, token), logprobs in zip(step.produced, step.logprobs):
            if seq.request_id not in self.seqs:
                continue
            seq.token_ids.append(token)
            self.send(token_event(seq.request_id, token, logprobs))
            reason = finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._drop(seq.request_id, reason)
        self.send({"ev": "done", "rid": seq.request_id, "finish_reason": reason})

    def _drop(self, rid: str, reason: str) -> None:
        self.remote.pop(rid, None)
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.runtime.release(seq, reason)

    def stats(self) -> dict:
        sched = self.runtime.scheduler
        return {"waiting": len(sched.waiting) + len(self.admit_queue),
                "running": len(sched.running), "awaiting_kv": len(self.remote),
                "free_blocks": self.runtime.blocks.num_free_blocks,
                "preemptions": sched.num_preemptions}
