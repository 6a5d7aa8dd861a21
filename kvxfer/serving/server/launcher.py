"""Start, watch and stop the worker processes.

Each worker is ``python -m kvxfer.serving.workers`` with one end of a private
socket pair (:mod:`kvxfer.serving.channel.ipc`). The agents' shared secret travels in
the child's environment (``KVXFER_AGENT_SECRET``), never on a command line and
never in a log.

Crash detection: a worker's channel reaching end of stream, or its process
exiting, marks it dead at once; :class:`Cluster` then calls ``on_worker_exit``
so the dispatcher can fail that worker's in-flight requests. The router stays
up; ``/health`` reports the dead worker.

Supervision: a worker that died (any exit not asked for by a drain) is started
again after a backoff (``restart_backoff_s``, doubling per consecutive quick
death up to ``restart_backoff_max_s``; a worker that stayed up
``STABLE_AFTER_S`` starts over at the base delay). It gets the same name and
role and a new agent address; it takes requests again once it reports ready.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from ...errors import KVXferError
from ..channel.ipc import AGENT_SECRET_ENV, RouterChannel
from .serve_config import ServeConfig, WorkerSpec
from .worker_ref import WorkerRef, relay_messages

log = logging.getLogger("kvxfer.serve")

STABLE_AFTER_S = 60.0  # a worker up this long before dying restarts after the base delay


class WorkerStartError(KVXferError):
    """A worker process exited or stayed silent before reporting ready."""


def sim_args(config) -> list[str]:
    """The worker flags of ``--engine sim`` (empty for the real engine)."""
    if config.engine != "sim":
        return []
    args = ["--engine", "sim", "--profile", config.profile]
    if config.sim_kv_scale:
        args += ["--sim-kv-scale", str(config.sim_kv_scale)]
    return args


class WorkerProcess(WorkerRef):
    """One worker: its process, its channel, and the requests it holds."""

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec.name, spec.role)
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0  # successful restarts after a death
        self.quick_deaths = 0  # consecutive deaths/failed starts within STABLE_AFTER_S
        self.is_restarting = False
        self.sim_share: str | None = None  # --sim-devices: "PATH:SLOT" of the shared busy file

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else f"dead(exit={self.exit_code})"
        return f"WorkerProcess({self.name}, {state}, inflight={len(self.inflight)})"

    async def start(self, config: ServeConfig, secret: bytes) -> None:
        """Spawn the process and wait for ``ready``; a failure or cancellation kills it."""
        try:
            await self._start(config, secret)
        except BaseException:
            self.kill()
            if self.channel is not None:
                self.channel.close()
            raise

    async def _start(self, config: ServeConfig, secret: bytes) -> None:
        if self.channel is not None:  # a restart: the old channel is dead
            self.channel.close()
            self.channel = None
        self.info = {}
        parent, child = socket.socketpair()
        args = [sys.executable, "-m", "kvxfer.serving.workers",
                "--name", self.name, "--role", self.role,
                "--ipc-fd", str(child.fileno()),
                "--threads", str(self.spec.num_threads),
                "--max-num-seqs", str(config.max_num_seqs),
                "--max-num-batched-tokens", str(config.max_num_batched_tokens),
                "--schedule", config.schedule,
                "--matmul-dtype", config.matmul_dtype,
                "--transfer-timeout", str(config.transfer_timeout_s),
                "--request-timeout", str(config.request_timeout_s),
                "--on-transfer-failure", config.on_transfer_failure,
                "--log-level", config.log_level]
        if config.num_blocks is not None:  # else the worker's default (its profile's capacity)
            args += ["--num-blocks", str(config.num_blocks)]
        if self.spec.tp != 1:  # --engine sim: the GPUs it models
            args += ["--tp", str(self.spec.tp)]
        if self.spec.cpus is not None:
            args += ["--cpus", ",".join(map(str, self.spec.cpus))]
        if self.role == "prefill" and config.prefill_nice:
            args += ["--nice", str(config.prefill_nice)]
        if config.model_path:
            args += ["--model", config.model_path]
        if config.store:
            args += ["--store", config.store]
            if config.secret_file:
                args += ["--store-secret-file", config.secret_file]
        args += sim_args(config)
        if self.sim_share is not None:
            args += ["--sim-devices", str(config.sim_devices), "--sim-share", self.sim_share]
        if config.step_log_dir:
            args += ["--step-log", config.step_log_dir]
        env = dict(os.environ)
        env.update(config.worker_env)
        env[AGENT_SECRET_ENV] = secret.hex()
        self.proc = subprocess.Popen(args, pass_fds=(child.fileno(),), env=env,
                                     stdin=subprocess.DEVNULL)
        child.close()
        self.started_at = time.monotonic()
        self.channel = await RouterChannel.open(parent)
        try:
            ready = await asyncio.wait_for(self.channel.recv(), config.startup_timeout_s)
        except asyncio.TimeoutError:
            raise WorkerStartError(f"{self.name} not ready after {config.startup_timeout_s:.0f}s") from None
        if not ready or ready.get("ev") != "ready":
            code = await asyncio.to_thread(self.proc.wait, 10) if ready is None else None
            detail = ready.get("error") if ready else f"exit code {code}"
            raise WorkerStartError(f"{self.name} failed to start: {detail}")
        self.info = ready
        self.exit_code = None
        self.is_alive = True

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def health(self) -> dict:
        return {"name": self.name, "role": self.role, "alive": self.is_alive,
                "pid": self.proc.pid if self.proc else None, "exit_code": self.exit_code,
                "inflight": self.load, "draining": self.is_draining,
                "switching": self.is_switching, "restarts": self.restarts,
                "restarting": self.is_restarting,
                "cpus": list(self.spec.cpus) if self.spec.cpus else None,
                "threads": self.spec.num_threads, "matmul": self.info.get("matmul"),
                "nice": self.info.get("nice"),
                "transport": self.info.get("transport")}


class Cluster:
    """All workers of one server; created and stopped by the router's lifespan."""

    def __init__(self, config: ServeConfig,
                 on_message: Callable[[WorkerProcess, dict], None],
                 on_worker_exit: Callable[[WorkerProcess], None]):
        self.config = config
        self.workers = [WorkerProcess(spec) for spec in config.worker_specs()]
        self._on_message = on_message
        self._on_worker_exit = on_worker_exit
        self._tasks: list[asyncio.Task] = []
        self._secret = secrets.token_bytes(32)  # per server; agents authenticate with it
        self._is_stopping = False
        self.routing = config.routing_policy()  # its prefix index follows the workers' kv_events
        self.sim_device_file = None  # --sim-devices: the busy file the simulated workers share
        if config.sim_devices and self.workers:
            from ..simulated.devices import create_device_file

            self.sim_device_file = create_device_file(len(self.workers))
            for slot, w in enumerate(self.workers):
                w.sim_share = f"{self.sim_device_file}:{slot}"

    def role(self, role: str) -> list[WorkerProcess]:
        return [w for w in self.workers if w.role == role]

    def pick(self, role: str, prompt_ids: list[int] | None = None) -> WorkerProcess | None:
        """The live worker of ``role`` the routing policy picks for ``prompt_ids``
        (None if none is alive)."""
        return self.route(role, prompt_ids).worker

    def route(self, role: str, prompt_ids: list[int] | None = None, **booking):
        """:meth:`pick` as a :class:`~kvxfer.serving.server.routing.Route` (with its prefix
        hit); ``booking``: ``request_id``, ``max_tokens``, ``prefills`` (the policy's ledger)."""
        live = [w for w in self.role(role)
                if w.is_alive and not w.is_draining and not w.is_switching]
        return self.routing.route(live, prompt_ids, **booking)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start(self.config, self._secret) for w in self.workers))
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        for w in self.workers:
            self._serve(w)
        self._tasks.append(asyncio.create_task(self._watch(), name="watch-workers"))

    def _serve(self, worker: WorkerProcess) -> None:
        self.routing.set_capacity(worker.name, worker.info.get("num_blocks") or self.config.num_blocks)
        self._tasks.append(asyncio.create_task(self._read(worker), name=f"read-{worker.name}"))
        log.info("worker %s ready (pid %d, transport %s)", worker.name, worker.proc.pid,
                 worker.info.get("transport"))

    async def _read(self, worker: WorkerProcess) -> None:
        await relay_messages(worker, self._on_message)
        for _ in range(100):  # the socket closes as the process exits: reap it for its code
            if worker.poll() is not None:
                break
            await asyncio.sleep(0.01)
        self._mark_dead(worker)

    async def _watch(self) -> None:
        # Channel EOF normally reports a death first; this catches a hung-up
        # process whose socket is still open (e.g. inherited by a grandchild).
        while True:
            await asyncio.sleep(0.5)
            for w in self.workers:
                if w.is_alive and w.poll() is not None:
                    self._mark_dead(w)
                elif not w.is_alive and w.exit_code is None:
                    w.exit_code = w.poll()

    def _mark_dead(self, worker: WorkerProcess) -> None:
        if not worker.is_alive:
            return
        worker.is_alive = False
        worker.exit_code = worker.poll()  # may still be None: _watch fills it in
        if worker.is_draining or worker.exit_code == 0:
            log.info("worker %s exited (exit code %s)", worker.name, worker.exit_code)
        else:
            log.error("worker %s died (exit code %s); failing its %d in-flight requests",
                      worker.name, worker.exit_code, worker.load)
        self._on_worker_exit(worker)
        if self.config.restart_workers and not worker.is_draining and not self._is_stopping:
            worker.is_restarting = True
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._restart(worker), name=f"restart-{worker.name}"))

    async def _restart(self, worker: WorkerProcess) -> None:
        """Start ``worker`` again until it reports ready, backing off between tries."""
        if time.monotonic() - worker.started_at >= STABLE_AFTER_S:
            worker.quick_deaths = 0
        try:
            while not self._is_stopping:
                delay = min(self.config.restart_backoff_s * 2 ** min(worker.quick_deaths, 16),
                            self.config.restart_backoff_max_s)
                worker.quick_deaths += 1
                log.warning("restarting worker %s in %.1fs", worker.name, delay)
                await asyncio.sleep(delay)
                if self._is_stopping:
                    return
                try:
                    await worker.start(self.config, self._secret)
                except (WorkerStartError, OSError) as exc:
                    log.error("restart of worker %s failed: %s", worker.name, exc)
                    continue
                worker.restarts += 1
                self._serve(worker)
                return
        finally:
            worker.is_restarting = False

    async def stop(self) -> None:
        """Drain: ask every worker to finish and exit; kill stragglers."""
        self._is_stopping = True
        for task in self._tasks:  # a restart in progress kills what it started
            if task.get_name().startswith("restart-"):
                task.cancel()
        for w in self.workers:
            w.is_draining = True
            if w.is_alive:
                try:
                    w.send({"op": "shutdown"})
                except ConnectionError:
                    pass
        deadline = time.monotonic() + self.config.drain_timeout_s
        for w in self.workers:
            while w.proc is not None and w.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.poll() is None and w.proc is not None:
                w.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                w.kill()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            if w.channel is not None:
                w.channel.close()
            w.is_alive = False
            w.exit_code = w.poll()
        if self.sim_device_file is not None:
            try:
                os.unlink(self.sim_device_file)
            except FileNotFoundError:
                pass

    def health(self) -> dict:
        workers = [w.health() for w in self.workers]
        roles = ("colocated",) if not self.config.is_disaggregated else ("prefill", "decode")
        serving = all(any(w.is_alive for w in self.role(r)) for r in roles)
        degraded = any(not w.is_alive for w in self.workers)
        status = "ok" if serving and not degraded else ("degraded" if serving else "down")
        return {"status": status,
                "mode": "disaggregated" if self.config.is_disaggregated else "colocated",
                "workers": workers}
