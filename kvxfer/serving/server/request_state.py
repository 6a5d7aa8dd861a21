"""One request's state in the router (:class:`kvxfer.serving.server.dispatch.Dispatcher`)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .launcher import WorkerProcess


@dataclass
class RequestState:
    rid: str
    prompt_ids: list[int]
    params: dict
    t_arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    transfer_settled: asyncio.Event = field(default_factory=asyncio.Event)
    prefill: WorkerProcess | None = None
    decode: WorkerProcess | None = None
    first_token: int | None = None
    token_times: list[float] = field(default_factory=list)
    cached_blocks: int = 0
    admitted: bool = False  # the decode worker has allocated its KV blocks (``ev: admitted``)
    kv_bytes: int = 0
    kv_transfer_ms: float | None = None  # prefill side: send posted -> data visible at decode
    recomputed: bool = False
    is_transfer_failed: bool = False
    is_finished: bool = False
    public_rid: str = ""  # the client-facing id; ``rid`` is the current attempt's wire id
    attempts: int = 0  # retries so far

    def __post_init__(self) -> None:
        self.public_rid = self.public_rid or self.rid

    def summary(self) -> dict:
        """The ``kvxfer`` object of the final chunk / response (see docs/serving.md)."""
        return {"kv_bytes": self.kv_bytes, "kv_transfer_ms": self.kv_transfer_ms,
                "recomputed": self.recomputed, "cached_blocks": self.cached_blocks,
                "prefill_worker": self.prefill.name if self.prefill else None,
                "decode_worker": self.decode.name if self.decode else None,
                "ttft_ms": self.ttft_s * 1e3 if self.ttft_s is not None else None}

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.t_arrival if self.token_times else None
