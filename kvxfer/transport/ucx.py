"""The default backend: UCX one-sided put/get, with a same-host one-copy fast path.

Bytes move over one of two paths, chosen per connection in :meth:`UcxBackend.connect`
and reported by ``Connection.transport``:

* ``"vm"``: both processes on one host (same boot id, hostname and pid
  namespace) and the kernel lets this process ``process_vm_writev`` into the
  peer (checked by reading a random token from the peer's probe area and writing
  one scratch byte). :meth:`~UcxBackend.post` copies the whole batch before it
  returns, up to ``IOV_MAX`` ranges per system call.
* ``"ucx:<tl>"``: ``ucp_put_nbx``/``ucp_get_nbx`` per coalesced range, then
  ``ucp_ep_flush_nbx``; the request completes when the flush does. ``<tl>`` is
  the UCX transport of the RMA lane (``cma``, ``tcp``, ``rc_mlx5``, ``cuda_ipc``
  ...), or ``"<am lane>+am-rma"`` when UCX emulates RMA over active messages.
  That lane carries host memory; UCX picks lanes per memory type, so GPU memory
  may move on another (``UcxConnection.device_transport``: ``"ucx:cuda_ipc"``
  when the endpoint has a CUDA IPC lane, as two processes on one host do).
  UCX's emulation would apply any address a peer names, so there kvxfer carries
  every host-memory write and read in its own messages, which the *target*
  checks against its registered regions (refused: :class:`~kvxfer.errors.InvalidDescriptor`
  on the initiator, counted in :attr:`UcxBackend.num_rejected` on the target;
  see docs/registration.md, "What is checked where").

Descriptors are ``int64 [n, 5]`` rows ``(local_region, local_offset,
remote_region, remote_offset, length)``, validated in full (C++) before anything
moves. Progress is explicit: :meth:`test`, :meth:`wait`, :meth:`progress`
and :meth:`arm` drive UCX. A *target* must drive it
too: emulated RMA over TCP is served, and connections that peers opened or
closed are accepted and reaped, only while it progresses. :meth:`event_fd`
becomes readable when UCX has such work (after :meth:`arm` returned True), so an
owner can sleep in ``select`` and call :meth:`arm` when it fires (the Agent's
I/O thread does). Notifications are not the backend's: the agent sends them on
its control channel after the data completed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import KVXferError
from ..memory import MemoryRegistry
from .base import Backend, Capabilities, Connection

log = logging.getLogger("kvxfer.transport")

_OPS = {"write": True, "read": False}

# UCX settings kvxfer changes from UCX's defaults (AgentConfig.ucx adds to / overrides
# them; an explicit UCX_<key> environment variable wins over both, UCX's own rule):
# - TCP_*_SEG_SIZE: UCX carries kvxfer's target-checked messages (and emulated RMA) over
#   TCP as active-message segments; 8 KiB segments cap it at ~0.4x a plain socket,
#   64 KiB reached 0.76-0.81x iperf3 over veth at 64 KiB-1 MiB runs, 512 KiB 0.93-1.14x
#   (docs/deploy.md, "Tuning KV transfers over TCP").
# - CMA_MEMORY_INVALIDATE: with peer error handling UCX only puts an RMA lane on a memory
#   domain that advertises remote-key invalidation, which UCX uses to fence a failed peer
#   out of a rendezvous buffer. CMA does not claim it unless this is "y", so on one host
#   put/get would be emulated over shared-memory active messages (~1 GB/s, target
#   progress needed). kvxfer never relies on that fencing (its data moves by one-sided
#   put/get the initiator drives, or its own target-checked messages), so it turns the claim on:
#   cma zero-copy RMA, peer failure still reported (cma ep_check, keepalive on the am
#   lane, the pidfd). See docs/registration.md.
UCX_DEFAULTS = {"TCP_TX_SEG_SIZE": "512k", "TCP_RX_SEG_SIZE": "512k", "CMA_MEMORY_INVALIDATE": "y"}


@dataclass
class UcxConnection(Connection):
    """A :class:`Connection` plus what the UCX backend knows about the peer."""

    peer_uid: int = 0  # the peer engine's random id; notifications carry it
    peer_pid: int = 0
    peer_host: str = ""
    ucx_info: str = ""  # ucp_ep_print_info() of the endpoint (lanes and protocols)
    lanes: int = 1  # endpoints (TCP connections) a request is striped over (AgentConfig.tcp_lanes)
    shared_regions: int = 0  # vm path: the peer's regions in kvxfer.shared_empty memory, mapped here
    shared_addrs: dict = field(default_factory=dict)  # vm path: region id -> its first byte's address here
    # what carries GPU memory: "ucx:cuda_ipc" when the endpoint has a CUDA IPC RMA lane, else
    # `transport` (UCX stages device memory through that lane); "" means `transport`
    device_transport: str = ""

    def __post_init__(self) -> None:
        if not self.device_transport:
            self.device_transport = "ucx:cuda_ipc" if "cuda_ipc" in rma_lanes(self.ucx_info) else self.transport


def rma_lanes(ucx_info: str) -> list:
    """Transports of the ``rma_bw`` lanes in ``ucp_ep_print_info`` text, in lane order, e.g.
    ``"lane[3]:  5:cuda_ipc/cuda.0 md[5] -> md[5]/cuda_ipc/sysdev[0] seg 4294967295 rma_bw#0"``
    -> ``cuda_ipc`` (UCX 1.22, two processes on one H200)."""
    out = []
    for line in ucx_info.splitlines():
        head, sep, rest = line.partition("lane[")
        if not sep or "rma_bw" not in rest:
            continue
        fields = rest.partition(":")[2].split()
        if fields:
            out.append(fields[0].split(":", 1)[-1].partition("/")[0])
    return out


def as_descs(descs):
    """Return ``descs`` (ndarray, tensor or sequence of 5-tuples) as a C-contiguous int64 ``[n, 5]`` array."""
    import numpy as np

    if hasattr(descs, "detach") and hasattr(descs, "cpu"):  # torch.Tensor
        descs = descs.detach().cpu().numpy()
    arr = np.asarray(descs)
    if arr.size == 0 and arr.ndim <= 1:  # [] -> an empty batch
        arr = np.zeros((0, 5), np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"descriptors must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(f"descriptors must have shape [n, 5], got {list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > 2**63 - 1:
        raise ValueError("descriptor value does not fit int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


class UcxBackend(Backend):
    """Registration and one-sided data movement over UCX (one instance per agent).

    ``allow_vm=False`` forces UCX even on one host; ``require_vm=True`` makes
    :meth:`connect` raise :class:`~kvxfer.errors.KVXferError` unless the vm
    path is available; ``pin`` is the default for host-memory pinning;
    ``net_devices`` narrows the network devices UCX opens (a ``UCX_NET_DEVICES``
    value, see :mod:`kvxfer.transport.netdev`; None keeps UCX's default).
    ``config``: the :class:`~kvxfer.AgentConfig` whose transport knobs apply
    (``ucx``, ``hugepages``, ``copy_threads``, ``vm_split_bytes``; default: the defaults).
    """

    def __init__(self, *, allow_vm: bool = True, require_vm: bool = False, pin: bool = True,
                 net_devices: str | None = None, config=None):
        from .._native import load
        from ..config import AgentConfig

        config = AgentConfig() if config is None else config
        settings = {**UCX_DEFAULTS, **({"NET_DEVICES": net_devices} if net_devices else {}),
                    **config.ucx_settings()}
        native = load()
        # the copy pool is the process's: the first agent that sets copy_threads fixes it,
        # a different setting later raises ValueError (csrc/vm_copy.h)
        native.set_vm_copy_threads(config.copy_threads or 0)
        split = native.VM_SPLIT_BYTES if config.vm_split_bytes is None else config.vm_split_bytes
        self._allow_vm = allow_vm or require_vm
        self._require_vm = require_vm
        self._engine = native.Engine(self._allow_vm, settings, config.hugepages, config.tcp_lanes, split)
        self.registry = MemoryRegistry(self._engine, pin=pin)
        self._conns: dict[int, UcxConnection] = {}

    # -- identity / capabilities ------------------------------------------
    @property
    def uid(self) -> int:
        """Random id of this engine; the first element of every received notification."""
        return self._engine.uid

    @property
    def num_rejected(self) -> int:
        """Peers' transfers this process refused as their target (a range outside its regions)."""
        return self._engine.num_rejected

    @property
    def num_endpoints(self) -> int:
        """UCX endpoints this backend opened to peers and has not closed (every lane counts)."""
        return self._engine.num_endpoints

    def capabilities(self) -> Capabilities:
        return Capabilities(name="ucx", per_desc_overhead_us=0.1)

    # -- registration -------------------------------------------------------
    def register(self, addr: int, length: int, *, device: str = "cpu", device_id: int = 0) -> int:
        return self.registry.register(addr, length, device=device, device_id=device_id).region_id

    def register_tensor(self, tensor) -> int:
        """Register a tensor's storage span; return its region id."""
        return self.registry.register_tensor(tensor).region_id

    def deregister(self, region_id: int) -> None:
        self.registry.deregister(region_id)

    def metadata(self) -> bytes:
        return self._engine.metadata()

    # -- connections --------------------------------------------------------
    def connect(self, peer_metadata: bytes) -> UcxConnection:
        """Parse a peer's :meth:`metadata`, create the endpoint, choose vm or UCX.

        Raises ``TypeError`` for non-bytes and :class:`~kvxfer.errors.ProtocolError`
        for truncated or corrupted metadata (nothing reaches UCX then).
        """
        if not isinstance(peer_metadata, (bytes, bytearray, memoryview)):
            raise TypeError(f"peer metadata must be bytes, got {type(peer_metadata).__name__}")
        conn_id = self._engine.connect(bytes(peer_metadata), self._allow_vm)
        info = self._engine.conn_info(conn_id)
        conn = UcxConnection(peer_id=conn_id, transport=info["transport"],
                             remote_regions=dict(info["regions"]), peer_uid=info["peer_uid"],
                             peer_pid=info["peer_pid"], peer_host=info["peer_host"],
                             ucx_info=info["ucx_info"], lanes=info["lanes"],
                             shared_regions=info["shared_regions"], shared_addrs=dict(info["shared_addrs"]))
        if self._require_vm and conn.transport != "vm":
            self._engine.disconnect(conn_id)
            raise KVXferError(f"same-host vm path unavailable to peer pid {conn.peer_pid} "
                              f"on {conn.peer_host!r} (UCX would use {conn.transport})")
        log.info("connected to peer %x (pid %d on %s) via %s, %d lane(s), %d shared region(s)", conn.peer_uid,
                 conn.peer_pid, conn.peer_host, conn.transport, conn.lanes, conn.shared_regions)
        log.debug("UCX endpoint of peer %x:\n%s", conn.peer_uid, conn.ucx_info)
        self._conns[conn_id] = conn
        return conn

    def disconnect(self, conn: Connection) -> None:
        """Close the endpoint (force: a dead peer cannot hang it); idempotent."""
        self._conns.pop(conn.peer_id, None)
        self._engine.disconnect(conn.peer_id)

    # -- data movement ------------------------------------------------------
    def post(self, conn: Connection, op: str, descs) -> int:
        """Validate the whole batch, then post it; return a request id.

        ``descs``: int64 ``[n, 5]`` (see :mod:`kvxfer.transport.base`). Raises
        :class:`~kvxfer.errors.InvalidDescriptor` before moving any byte if a row
        is out of bounds, zero-length, overlapping, or names an unknown region;
        :class:`~kvxfer.errors.PeerDisconnected` if the peer is gone. On the vm
        path the copy is done when this returns; on UCX, after :meth:`test` is True.
        """
        if op not in _OPS:
            raise ValueError(f"op must be 'write' or 'read', got {op!r}")
        return self._engine.post(conn.peer_id, _OPS[op], as_descs(descs))

    def test(self, request_id: int) -> bool:
        return self._engine.test(request_id)

    def wait(self, request_id: int, timeout: float) -> None:
        self._engine.wait(request_id, float(timeout))

    def progress(self) -> int:
        """Drive UCX once; returns the number of events processed."""
        return self._engine.progress()

    # -- a store node's key table, asked by peers ---------------------------------------
    def serve_key_table(self, base: int, nbuckets: int) -> bool:
        """Answer peers' lookups from the key table at ``base``, inside UCX progress
        (csrc/remote_lookup.cpp)."""
        self._engine.serve_key_table(base, nbuckets)
        return True

    def post_lookup(self, conn: Connection, keys: list) -> int:
        """One message with the keys' hashes to a peer on UCX (not the vm path: map its table)."""
        if conn.transport == "vm":
            raise KVXferError("a same-host peer's key table is read where it is mapped")
        return self._engine.post_lookup(conn.peer_id, keys)

    def lookup_result(self, request_id: int) -> bytes:
        return self._engine.lookup_result(request_id)

    @property
    def num_lookups(self) -> int:
        """Peers' lookups this process answered from its served key table."""
        return self._engine.num_lookups

    def needs_progress(self, conn: Connection) -> bool:
        """UCX transports (not the ``vm`` path) are served by the target's progress."""
        return conn.transport.startswith("ucx")

    def event_fd(self) -> int | None:
        """The UCX worker's event fd (an epoll fd the engine owns; None once closed)."""
        fd = self._engine.event_fd
        return None if fd < 0 else fd

    def arm(self) -> bool:
        """Progress until idle, then arm :meth:`event_fd`; False while events are still pending."""
        return self._engine.arm()

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        self._conns.clear()
        self._engine.close()

    def __repr__(self) -> str:
        state = "closed" if self._engine.closed else f"{len(self._conns)} connections"
        return f"UcxBackend(uid={self.uid:#x}, {state}, regions={len(self.registry)})"
