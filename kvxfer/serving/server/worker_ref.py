"""The router's view of one worker, whether it spawned it or found it through discovery.

:class:`WorkerRef` holds what the dispatcher reads: name, role, the channel, the
worker's ``ready`` message (``info``), the requests it holds (``inflight``) and
its state. :class:`kvxfer.serving.server.launcher.WorkerProcess` (a local
process) and :class:`kvxfer.serving.server.remote.RemoteWorker` (a worker on
any host) add how they start, watch and stop it.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("kvxfer.serve")


class WorkerRef:
    def __init__(self, name: str, role: str):
        self.name = name
        self.role = role
        self.channel = None  # kvxfer.serving.channel.ipc.RouterChannel once connected
        self.info: dict = {}
        self.inflight: set[str] = set()
        self.is_alive = False
        self.is_draining = False
        self.is_switching = False  # adaptive rebalancing: drained for a role change
        self.exit_code: int | None = None  # known for local processes only

    @property
    def load(self) -> int:
        return len(self.inflight)

    @property
    def agent_address(self) -> str | None:
        return self.info.get("agent_address")

    def send(self, msg: dict) -> None:
        """Queue ``msg`` for the worker; ``ConnectionError`` while it is down."""
        if not self.is_alive or self.channel is None:
            raise ConnectionError(f"worker {self.name} is not connected")
        self.channel.send(msg)


async def relay_messages(worker: WorkerRef, on_message: Callable[[WorkerRef, dict], None]) -> None:
    """Hand each message of ``worker``'s channel to ``on_message(worker, msg)`` until the
    channel ends; a handler's exception is logged and the next message read."""
    channel = worker.channel
    while (msg := await channel.recv()) is not None:
        try:
            on_message(worker, msg)
        except Exception:  # one bad message must not stop the reader
            log.exception("handling %s from %s", msg.get("ev"), worker.name)
