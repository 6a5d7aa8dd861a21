"""``kvxfer.AgentConfig``: every knob of an agent, as one frozen, validated value.

Built once at the entry point and passed down: ``Agent(..., config=AgentConfig(...))``
hands the transport knobs to the backend (and through it to ``kvxfer._C``), the
per-peer limits to every peer's book and the timeouts to the I/O loop. The bounds
every listener applies before a connection authenticated (``PREAUTH_MAX_FRAME``,
``HANDSHAKE_TIMEOUT_S``, the pending-handshake slots) are defined here too, once, for
the agents, the store nodes and the serving workers' router channel. An Agent
given no config uses ``AgentConfig()``, the defaults. The ``KVXFER_*`` variables are
read in one place, :meth:`AgentConfig.from_env`, which only entry points call (the
``kvxfer`` CLI commands, ``kvxfer worker``, the vLLM connector, the benchmarks;
documented in ``docs/api.md``, "AgentConfig"); there a field the caller gives
explicitly beats the environment. The deployment's secret (a file, else
``KVXFER_SECRET``) is read by :func:`kvxfer.secrets.load_secret`, called by the entry
points and by the router's clients of remote workers and of the KV pool (which take the
file from ``ServeConfig.secret_file``). Nothing else below the entry point reads a
``KVXFER_*`` variable. What else is read is
another tool's process-wide knob, not an agent's: UCX reads its own ``UCX_*``
variables (an explicit one beats ``AgentConfig.ucx``, UCX's rule), loading ``kvxfer._C`` sets ``UCX_MM_ERROR_HANDLING=y`` unless it is set (or ``UCX_TLS``
leaves out UCX's shared-memory transports), the
pack kernels check Triton's ``TRITON_INTERPRET``, and :mod:`kvxfer.report.envinfo`
records the environment a benchmark ran in.::

    cfg = AgentConfig.from_env(staging_bytes=64 << 20)   # KVXFER_* applied, then the explicit field
    agent = kvxfer.Agent("p", secret=s, config=cfg)
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from .transport.paths import CostModel

__all__ = ["AgentConfig", "PeerLimits", "HANDSHAKE_TIMEOUT_S", "PREAUTH_MAX_FRAME", "MAX_PENDING_HANDSHAKES",
           "MAX_PENDING_PER_SOURCE", "HELLO_DEADLINE_S"]

HUGEPAGES_MODES = ("advise", "collapse", "off")
PATHS = ("auto", "zero_copy", "pack")

# KVXFER_* variable -> (field, parser); read only by AgentConfig.from_env
ENV_OVERRIDES = {
    "KVXFER_HUGEPAGES": ("hugepages", str),
    "KVXFER_VM_THREADS": ("copy_threads", int),
    "KVXFER_VM_SPLIT_BYTES": ("vm_split_bytes", int),
    "KVXFER_STAGING_BYTES": ("staging_bytes", int),
    "KVXFER_PATH": ("path", str),
    "KVXFER_TCP_LANES": ("tcp_lanes", int),
    "KVXFER_LOOP_SPIN_S": ("loop_spin_s", float),
    "KVXFER_PEER_COPY": ("peer_copy", "bool"),
}
# csrc/stripe.h kMaxTcpLanes (_C.MAX_TCP_LANES): kept here so validating a config loads
# no extension; tests/test_cli_bench.py checks the two agree
MAX_TCP_LANES = 16
MAX_SPIN_S = 0.01  # a busy-poll window is bounded: at most 10 ms of a core per event

# ---- per-peer bounds (what connected peers can make an agent hold; docs/api.md, "Limits")
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

# ---- before authentication (every listener of a deployment: agents, store nodes and
# the serving workers' router channel; docs/api.md, "Limits")
HANDSHAKE_TIMEOUT_S = 10.0  # a whole handshake, from accept (AgentConfig.handshake_timeout's default)
PREAUTH_MAX_FRAME = 4096  # bytes of one frame before authentication (the proofs are ~100)
MAX_PENDING_HANDSHAKES = 256  # unauthenticated connections held at once (HandshakeGate)
MAX_PENDING_PER_SOURCE = 16  # of them from one source address
HELLO_DEADLINE_S = 2.0  # every listener drops a connection whose handshake has not begun by then

# what a tombstone costs besides the characters of its request id and reason: the
# two str headers, the (xid, code, reason, nbytes) tuple, its ints and the table slot
TOMBSTONE_OVERHEAD = 256


@dataclass(frozen=True)
class PeerLimits:
    """The bounds above (enforced by :mod:`kvxfer.agent.peers`), as one frozen value (``AgentConfig.limits``): the ``max_*`` fields
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



@dataclass(frozen=True)
class AgentConfig:
    """What an :class:`~kvxfer.Agent` is configured with (all fields have defaults).

    - ``staging_bytes``: size of each of the two registered staging buffers (pack path).
    - ``path``: ``"auto"`` (cost model), ``"zero_copy"`` or ``"pack"`` to force one.
    - ``lease_timeout``: seconds P holds blocks for a pending send, and D's default recv timeout.
    - ``cost_model``: the :class:`~kvxfer.transport.paths.CostModel` with which
      ``path="auto"`` picks zero-copy or pack per piece (a frozen value, so it is
      configuration); None: the default model with the backend's per-descriptor cost,
      at least 0.75 us (what ``process_vm_writev`` measured for runs of a few hundred bytes).
    - ``hugepages``: ``"advise"`` | ``"collapse"`` | ``"off"``: transparent huge pages for
      registered host ranges (``docs/registration.md``).
    - ``copy_threads``: threads (caller included) that copy one large same-host batch;
      None: min(cores, 2). One copy pool serves the process, so this is one value per
      process: the first agent that sets it fixes it, an agent asking for another
      count raises ValueError, None accepts it. ``vm_split_bytes``: this agent's
      batches from this size are split across them (0: never); None: 4 MiB.
    - ``ucx``: UCX settings applied with ``ucp_config_modify`` on top of kvxfer's
      defaults, as ``{"TCP_TX_SEG_SIZE": "64k"}`` (without the ``UCX_`` prefix). An
      explicit ``UCX_<key>`` environment variable still wins (UCX's own rule).
    - ``tcp_lanes``: TCP connections (UCP endpoints) per peer where UCX carries the data
      over TCP (``ucx:tcp+am-rma``); one request's bytes are split across them in
      contiguous, balanced ranges (at least 256 KiB each), so it is not capped at one
      TCP stream. Other transports keep one endpoint. 1..16; default 1: no reliable
      gain was measured on a 2-core machine (both cores busy copying bytes), more
      lanes are for machines with cores to spare (docs/benchmarks.md, "Striping one
      request over several TCP connections").
    - ``limits``: per-peer bounds (:class:`PeerLimits`).
    - ``handshake_timeout``: seconds for ``connect`` and an inbound handshake
      (default :data:`HANDSHAKE_TIMEOUT_S`).
    - ``progress_busy_s`` / ``progress_idle_s``: how often the I/O thread drives a UCX
      target while a recv is pending / otherwise (a backstop behind its event fd).
    - ``loop_spin_s``: after each event (and after a ``recv`` is posted), while a send
      or recv is outstanding, the I/O thread busy-polls its sockets up to this long
      (native, GIL released, yielding the CPU every round) before it blocks, so the
      peer's next message is read without a thread wake-up; 0: never. In ``[0, 0.01]``
      s. An agent with nothing outstanding, or no event for this long, blocks
      (``docs/benchmarks.md``, "Polling instead of waking").
    - ``peer_copy``: offer this agent's CUDA pool to same-node peers and map theirs, so a
      piece between two GPU pools of one node moves with one kernel launch
      (``transport="cuda_peer"``, :mod:`kvxfer.transport.cuda_peer`) when ``path`` is
      ``"auto"``; False: UCX carries every piece (``docs/api.md``, "Same-node GPU peers").
    """

    staging_bytes: int = 32 << 20
    path: str = "auto"
    lease_timeout: float = 30.0
    cost_model: CostModel | None = None
    hugepages: str = "advise"
    copy_threads: int | None = None
    vm_split_bytes: int | None = None
    ucx: tuple = ()  # ((key, value), ...); a dict is accepted too
    tcp_lanes: int = 1
    limits: PeerLimits = field(default_factory=PeerLimits)
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    progress_busy_s: float = 0.0005
    progress_idle_s: float = 0.05
    loop_spin_s: float = 0.002
    peer_copy: bool = True

    def __post_init__(self) -> None:
        _check_int("staging_bytes", self.staging_bytes, 4096)
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(f"AgentConfig.cost_model must be a CostModel or None, got {type(self.cost_model).__name__}")
        if self.hugepages not in HUGEPAGES_MODES:
            raise ValueError(f"hugepages must be one of {HUGEPAGES_MODES}, got {self.hugepages!r}")
        if self.copy_threads is not None:
            _check_int("copy_threads", self.copy_threads, 1)
        if self.vm_split_bytes is not None:
            _check_int("vm_split_bytes", self.vm_split_bytes, 0)
        _check_int("tcp_lanes", self.tcp_lanes, 1)
        if self.tcp_lanes > MAX_TCP_LANES:
            raise ValueError(f"AgentConfig.tcp_lanes must be <= {MAX_TCP_LANES}, got {self.tcp_lanes!r}")
        for key in self.ucx_settings():
            if not key or key.startswith("UCX_") or not key.replace("_", "").isalnum():
                raise ValueError(f"AgentConfig.ucx key {key!r}: a UCX setting name without the UCX_ prefix")
        if not isinstance(self.limits, PeerLimits):
            raise TypeError(f"AgentConfig.limits must be a PeerLimits, got {type(self.limits).__name__}")
        for name in ("lease_timeout", "handshake_timeout", "progress_busy_s", "progress_idle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"AgentConfig.{name} must be a finite number > 0, got {value!r}")
        if type(self.peer_copy) is not bool:
            raise TypeError(f"AgentConfig.peer_copy must be a bool, got {self.peer_copy!r}")
        value = self.loop_spin_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SPIN_S:
            raise ValueError(f"AgentConfig.loop_spin_s must be a number in [0, {MAX_SPIN_S}] s, got {value!r}")

    def ucx_settings(self) -> dict:
        """``ucx`` as ``{key: value}`` strings (TypeError if it is neither a dict nor pairs)."""
        try:
            items = self.ucx.items() if isinstance(self.ucx, dict) else self.ucx
            return {str(k): str(v) for k, v in items}
        except (TypeError, ValueError):
            raise TypeError(f"AgentConfig.ucx must be a dict or (key, value) pairs, got {self.ucx!r}") from None

    def replace(self, **changes) -> "AgentConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None, **fields) -> "AgentConfig":
        """``AgentConfig(**fields)`` with the documented ``KVXFER_*`` variables of
        ``environ`` (default ``os.environ``) filling the fields not given: an explicit
        field beats the environment. ``KVXFER_HUGEPAGES``, ``KVXFER_VM_THREADS``
        (``copy_threads``), ``KVXFER_VM_SPLIT_BYTES``, ``KVXFER_STAGING_BYTES``,
        ``KVXFER_PATH``, ``KVXFER_TCP_LANES``, ``KVXFER_LOOP_SPIN_S``, ``KVXFER_PEER_COPY``
        (``0`` or ``1``); a malformed
        value raises ValueError. For entry points only (the library never calls it)."""
        env = os.environ if environ is None else environ
        given = dict(fields)
        for var, (name, parse) in ENV_OVERRIDES.items():
            raw = env.get(var, "")
            if raw and name not in given:
                try:
                    fields[name] = _parse_bool(raw) if parse == "bool" else parse(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not a valid {name}") from None
        return cls(**fields)


def _parse_bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def _check_int(name: str, value, low: int) -> None:
    if type(value) is not int or value < low:
        raise ValueError(f"AgentConfig.{name} must be an int >= {low}, got {value!r}")
