"""``kvxfer.Agent``: one per process; register a pool once, connect, move blocks.

P (prefill) and D (decode) each run an agent. D's :meth:`Agent.recv` tells every
connected peer where request ``req`` goes (its block ids, layers and heads); P's
:meth:`Agent.send` writes there as soon as both sides are known, either first.
Completion on both sides means the data is visible in D's blocks.

Threads per agent: one I/O thread (control sockets, timers; blocks in
``select``), one send worker (plan, pack, post, wait) and one receive worker
(unpack). None spins; an idle agent uses no CPU.
"""
from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import uuid

from .control.handshake import HANDSHAKE_TIMEOUT_S, client_handshake
from .control.loop import IOLoop
from .control.peers import InboundHandler, Peer, PeerHandler, split_address
from .control.gate import HandshakeGate
from .control.messages import Msg, encode
from .control.receiver import ReceiverSide
from .control.sender import SenderSide
from .control import auth
from .errors import KVXferError, PeerDisconnected, ProtocolError, RegistrationError, TransferTimeout
from .control.parts import from_wire as parts_from_wire
from .control.parts import register_parts, to_wire as parts_to_wire
from .cuda_ranges import oracle_for, split_parts
from .kernels.common import device_guard
from .kernels.device import device_for
from .lease import LeaseTable
from .metrics import Metrics
from .plan import CostModel, Geometry
from .transport import make_backend


log = logging.getLogger("kvxfer.agent")


class Agent(SenderSide, ReceiverSide):
    """``Agent(name, listen="127.0.0.1:0", secret=..., backend="auto")``.

    ``secret`` (bytes/str, required): shared by every agent of a deployment; it
    never leaves the process. ``lease_timeout``: seconds P holds blocks for a
    pending send (default 30). ``on_release(request_id, block_ids, reason)``:
    called once per lease when blocks may be reused (``reason`` in done,
    cancelled, failed, expired, closed); it runs on an agent thread, possibly
    with the agent's lock held, so it must be quick and must not wait on the
    agent (hand the ids to your scheduler's queue). ``staging_bytes``: size of each of the
    two registered staging buffers (pack path). ``path``: ``"auto"`` (cost
    model), ``"zero_copy"`` or ``"pack"`` to force one. ``device``: where pack/unpack
    run and how their completion is awaited (a :class:`kvxfer.kernels.device.Device`;
    default: the pool's, chosen at :meth:`register_kv`; tests plug in a deferred one).
    """

    def __init__(self, name: str, listen: str = "127.0.0.1:0", *, secret, backend="auto",
                 lease_timeout: float = 30.0, on_release=None, staging_bytes: int = 32 << 20,
                 path: str = "auto", cost_model: CostModel | None = None, device=None) -> None:
        if path not in ("auto", "zero_copy", "pack"):
            raise ValueError(f"path must be auto, zero_copy or pack, got {path!r}")
        self.name = str(name)
        self.agent_id = uuid.uuid4().hex
        self._secret = auth.normalize_secret(secret)
        self._path = path
        self._device = device
        self._staging_bytes = int(staging_bytes)
        self.metrics = Metrics(self.name)
        self.leases = LeaseTable(lease_timeout, on_release)
        self._lock = threading.RLock()
        self._closed = False
        self._layout = None
        self._geometry: Geometry | None = None
        self._region_ids: list = []  # per region of the layout, its first part's id
        self._registered: list = []  # every part of every region and staging buffer
        self._parts: dict = {}  # regions registered in several parts (kvxfer/control/parts.py)
        self._peers: dict[int, Peer] = {}
        self._gate = HandshakeGate()  # pre-auth admission (I/O thread only)
        self._progress_on = False
        self._notifications: collections.deque = collections.deque()
        host, port = split_address(listen)
        self._backend = make_backend(backend, host)
        caps = self._backend.capabilities()
        # Backends quote their per-descriptor cost for large runs; for runs of a few hundred
        # bytes process_vm_writev measured ~0.75 us each (Llama-3-8B NHD->HND, 1M runs), so
        # that is the floor the zero-copy vs pack choice uses.
        self._cost = cost_model or CostModel(per_desc_us=max(caps.per_desc_overhead_us, 0.75))
        self.metrics.info["backend"] = caps.name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lsock.bind((host, port))
            lsock.listen(128)
        except OSError:
            lsock.close()
            self._backend.close()
            raise
        lsock.setblocking(False)
        self.address = f"{host}:{lsock.getsockname()[1]}"
        SenderSide.__init__(self)
        ReceiverSide.__init__(self)
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._recv_q: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, args=(q,), name=f"kvxfer-{n}-{self.name}",
                                          daemon=True) for q, n in ((self._send_q, "send"), (self._recv_q, "recv"))]
        for t in self._workers:
            t.start()
        self._loop = IOLoop(lsock, self._on_accept, self.name)
        self._watch_backend()

    # ---- registration ---------------------------------------------------------------
    def register_kv(self, layout) -> None:
        """Register the pool of ``layout`` (a :class:`~kvxfer.KVLayout`) and the staging
        buffers, once, before :meth:`connect`. Raises :class:`RegistrationError` on failure."""
        import torch

        with self._lock:
            self._check_open()
            if self._layout is not None:
                raise RegistrationError("register_kv was already called on this agent")
            if self._peers:
                raise RegistrationError("register_kv must come before connecting peers")
            registered = []
            kind, index = layout.device.type, layout.device.index or 0

            def register(addr, nbytes):
                rid = self._backend.register(addr, nbytes, device=kind, device_id=index)
                registered.append(rid)
                return rid

            try:
                # each region in parts that stay inside one device allocation (kvxfer/control/parts.py)
                region_ids, region_parts, _ = register_parts(register, layout.region_parts())
                with device_guard(layout.device):  # agent threads must not default to device 0
                    self._stage_in_t = torch.empty(self._staging_bytes, dtype=torch.uint8, device=layout.device)
                    self._stage_out_t = torch.empty(self._staging_bytes, dtype=torch.uint8, device=layout.device)
                if self._device is None:
                    self._device = device_for(layout)
                stage = [((t.data_ptr(), t.numel()),) for t in (self._stage_in_t, self._stage_out_t)]
                stage_ids, stage_parts, _ = register_parts(register, split_parts(
                    [p[0] for p in stage], oracle_for(layout.device)))
            except Exception as exc:
                for rid in registered:
                    self._backend.deregister(rid)
                if isinstance(exc, KVXferError):
                    raise
                raise RegistrationError(f"cannot register the KV pool: {exc}") from exc
            self._registered = registered
            self._region_ids = region_ids
            self._parts = {**region_parts, **stage_parts}
            self._stage_in_region, self._stage_out_region = stage_ids
            self._layout = layout
            self._geometry = Geometry.from_layout(layout)
            self._init_staging(self._staging_bytes)

    def _info(self) -> dict:
        layout = {}
        if self._geometry is not None:
            layout = {"geometry": self._geometry.to_wire(), "regions": self._region_ids,
                      "stage_region": self._stage_in_region, "parts": parts_to_wire(
                          {r: p for r, p in self._parts.items() if r != self._stage_out_region})}
        return {"name": self.name, "agent_id": self.agent_id, "layout": layout,
                "backend": self._backend.metadata(), "staging": self._staging_bytes}

    def _parse_info(self, fields: dict) -> dict:
        layout = fields["layout"]
        out = {"geometry": None, "regions": [], "stage_region": 0, "staging": fields["staging"], "parts": {}}
        if layout:
            try:
                geometry = Geometry.from_wire(layout["geometry"])
                regions, stage = layout["regions"], layout["stage_region"]
                ok = (set(layout) == {"geometry", "regions", "stage_region", "parts"} and type(stage) is int
                      and type(regions) is list and all(type(r) is int for r in regions)
                      and len(regions) == len(geometry.region_sizes) and type(fields["staging"]) is int)
                if ok:
                    sizes = dict(zip(regions, geometry.region_sizes))
                    sizes[stage] = fields["staging"]
                    out["parts"] = parts_from_wire(layout["parts"], sizes)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ProtocolError("invalid layout in INFO")
            if self._geometry is not None:
                self._geometry.check_compatible(geometry)
            out.update(geometry=geometry, regions=regions, stage_region=stage)
        return out

    # ---- connections ----------------------------------------------------------------
    def connect(self, address: str, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> Peer:
        """Connect and authenticate; raises AuthenticationError, LayoutMismatch,
        ProtocolError, ConnectionRefused (the peer is busy with other handshakes or
        refuses this address for now: retry later), PeerDisconnected (unreachable)
        or TransferTimeout."""
        self._check_open()
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except socket.timeout:
            raise TransferTimeout(f"connecting to {address} timed out") from None
        except OSError as exc:
            raise PeerDisconnected(f"cannot reach {address}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fields = client_handshake(sock, self._secret, self._info(), self._parse_info, timeout)
            peer = self._make_peer(fields, address)
        except socket.timeout:
            sock.close()
            raise TransferTimeout(f"handshake with {address} timed out") from None
        except KVXferError:
            sock.close()
            raise
        except (ConnectionError, OSError) as exc:
            sock.close()
            raise PeerDisconnected(f"{address} closed the connection during the handshake: {exc}") from None
        except BaseException:
            sock.close()
            raise
        peer.conn = self._loop.add_conn(sock, PeerHandler(self), peer)
        self._peer_ready(peer)
        return peer

    def _make_peer(self, fields: dict, address: str | None) -> Peer:
        peer = Peer(fields["name"], fields["agent_id"], address, self._parse_info(fields))
        peer.bconn = self._backend.connect(fields["backend"])
        self.metrics.info[f"transport:{peer.name}"] = peer.transport
        if peer.transport.startswith("ucx") and hasattr(self._backend, "progress"):
            self._start_progress()
        return peer

    # ---- target-side progress -----------------------------------------------------------
    # UCX serves emulated RMA (TCP), and accepts and reaps the connections peers open and
    # close, only while this process progresses it. The backend's event fd wakes the I/O
    # thread whenever UCX has such work, so an idle agent sleeps and still completes a
    # one-sided write into it and closes the sockets of departed peers. Once a peer is
    # reached through UCX, a timer also progresses every 0.5 ms while a recv, staging
    # grant or cancellation is pending, and every 50 ms otherwise (a missed wake-up costs
    # at most that).
    PROGRESS_BUSY_S = 0.0005
    PROGRESS_IDLE_S = 0.05

    def _watch_backend(self) -> None:
        fd = self._backend.event_fd()
        if fd is not None:
            self._loop.add_reader(fd, self._on_backend_event)
            self._loop.call_soon(self._on_backend_event)  # drain what came before, then arm

    def _on_backend_event(self) -> None:
        """I/O thread: the backend's fd fired; drive it and re-arm (again soon while busy)."""
        if self._closed:
            return
        try:
            armed = self._backend.arm()
        except KVXferError as exc:  # the timer below keeps driving it
            armed = True
            self.metrics.inc("failures", kind="progress", error=type(exc).__name__)
            log.warning("agent %r: arming the backend failed: %s", self.name, exc)
        if not armed:
            self._loop.call_soon(self._on_backend_event)

    def _start_progress(self) -> None:
        with self._lock:
            if self._progress_on:
                return
            self._progress_on = True
        self._loop.call_later(self.PROGRESS_BUSY_S, self._progress_tick)

    def _progress_tick(self) -> None:
        if self._closed:
            return
        busy = bool(self._recvs or self._grants or self._quiet_wait)
        if busy:
            self._backend.progress()
        else:
            self._on_backend_event()
        self._loop.call_later(self.PROGRESS_BUSY_S if busy else self.PROGRESS_IDLE_S, self._progress_tick)

    def _peer_ready(self, peer: Peer) -> None:
        with self._lock:
            if self._closed:
                peer.conn.loop.close_conn(peer.conn)
                return
            self._peers[peer.serial] = peer
            self._post_pending_recvs(peer)

    def _on_accept(self, sock, source: str):
        """I/O thread: a new inbound connection; refused ones get REJECT "busy" (the
        connecting agent raises ConnectionRefused) and are closed by the loop."""
        if self._closed:
            return None
        why = self._gate.admit(source)
        if why is None:
            return InboundHandler(self, source)
        self.metrics.inc("refused_connections")
        try:
            sock.setblocking(False)
            sock.send(encode(Msg.REJECT, code="busy", reason=why[:200]))
            sock.shutdown(socket.SHUT_WR)
            sock.recv(4096)  # what the client sent already; unread bytes would turn close into a reset
        except OSError:
            pass
        return None

    def peers(self) -> list:
        """Every connected peer (those we connected to and those that connected to us)."""
        with self._lock:
            return [p for p in self._peers.values() if p.is_connected]

    def _on_conn_closed(self, peer: Peer, exc) -> None:
        with self._lock:
            if not peer.is_connected:
                return
            peer.is_connected = False
            self._peers.pop(peer.serial, None)
        err = PeerDisconnected(f"peer {peer.name!r} disconnected: {exc}")
        self._sender_peer_lost(peer, err)
        self._receiver_peer_lost(peer, err)
        try:
            self._backend.disconnect(peer.bconn)
        except KVXferError:
            pass

    def disconnect(self, peer: Peer) -> None:
        """Close the control connection; that peer's pending transfers fail with PeerDisconnected."""
        if peer.conn is not None:
            peer.conn.loop.close_conn(peer.conn, ConnectionError("disconnected locally"))

    # ---- messages (I/O thread) --------------------------------------------------------
    def _on_message(self, peer: Peer, kind: Msg, f: dict) -> None:
        handler = self._dispatch.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected {kind.name} after the handshake")
        handler(self, peer, f)

    def _on_notify(self, peer: Peer, f: dict) -> None:
        with self._lock:
            peer.book.add_note(len(f["data"]))  # LimitExceeded closes this peer only
            self._notifications.append((peer, f["data"]))
        self.metrics.inc("notifications")

    def notifications(self) -> list:
        """Drain and return ``[(peer, bytes), ...]`` received since the last call, in order.
        Undrained notifications count against their peer's limits (``docs/api.md``)."""
        with self._lock:
            out = list(self._notifications)
            self._notifications.clear()
            for peer, data in out:
                peer.book.drain_note(len(data))
        return out

    # ---- workers ----------------------------------------------------------------------
    @staticmethod
    def _work(q: queue.SimpleQueue) -> None:
        """Worker loop. Jobs fail their own request on error; should one still raise, it
        is logged and the worker goes on (a dead worker would stall every later transfer)."""
        while True:
            job = q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - second line of defence, logged
                log.exception("kvxfer worker job raised")

    # ---- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise KVXferError(f"agent {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def held_blocks(self) -> dict:
        """``{request_id: block_ids}`` still lent to in-flight transfers (see :mod:`kvxfer.lease`)."""
        return self.leases.held()

    def close(self) -> None:
        """Fail pending handles, stop the threads, close the backend (every registration and
        endpoint), release every remaining lease ("closed"), free the staging buffers.

        Every step runs even when an earlier one fails; the first failure is raised after
        the last step (a :class:`KVXferError`; later ones are attached as notes). A second
        call returns at once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        err = KVXferError(f"agent {self.name!r} closed")
        failures: list = []

        def step(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - collected and raised below
                failures.append(exc)

        step(self._sender_close, err)
        step(self._receiver_close, err)
        if self._layout is not None:
            step(self._stage_out.close)
            step(self._stage_in.close)
        step(self._loop.stop)
        for q in (self._send_q, self._recv_q):
            q.put(None)
        for t in self._workers:
            if t is not threading.current_thread():
                t.join(10.0)
        if self._device is not None:  # nothing it launched still touches the staging buffers or the pool
            step(self._device.close)
        # Closing the backend releases every registration, cancels what is still in
        # flight (a timed-out transfer) and ends every endpoint, so no peer can write
        # into a block whose lease ends below.
        step(self._backend.close)
        for key in self.leases.keys():
            step(self.leases.release, key, "closed")
        self._release_memory()
        if failures:
            first = failures[0]
            if not isinstance(first, KVXferError):
                first = KVXferError(f"closing agent {self.name!r} failed: {first!r}").with_traceback(
                    first.__traceback__)
            for other in failures[1:]:
                first.add_note(f"also failed while closing: {other!r}")
            raise first

    def _release_memory(self) -> None:
        """Drop the staging buffers and everything a closed agent no longer needs, so they
        are freed now rather than by the cycle collector (the I/O loop and handles refer
        back to the agent)."""
        self._layout = None
        self._geometry = None
        self._stage_in_t = self._stage_out_t = None
        self._peers.clear()
        self._notifications.clear()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<Agent {self.name!r} {self.address} {state} backend={self.metrics.info.get('backend')}>"


Agent._dispatch = {**SenderSide._dispatch, **ReceiverSide._dispatch, Msg.NOTIFY: Agent._on_notify}
