"""``kvxfer.Agent``: one per process; register a pool once, connect, move blocks.

P (prefill) and D (decode) each run an agent. D's :meth:`Agent.recv` tells every
connected peer where request ``req`` goes (its block ids, layers and heads); P's
:meth:`Agent.send` writes there as soon as both sides are known, either first.
Completion on both sides means the data is visible in D's blocks.

The agent is a facade over components that each own their share (``kvxfer/agent/``):
an :class:`~kvxfer.agent.state.AgentState` they share (lock, backend, pool,
peers), the :class:`~kvxfer.agent.sender.Sender` (P side), the
:class:`~kvxfer.agent.receiver.Receiver` (D side), the
:class:`~kvxfer.agent.peers.Connections` (handshakes, peers, routing of
frames) and the I/O loop with its :class:`~kvxfer.agent.threads.BackendDriver`.

Threads per agent: one I/O thread (control sockets, timers; blocks in ``select``),
one send worker (pack, large writes) and one receive worker (unpack). A small
zero-copy piece is written by the thread that matched it, without a hop, where the
backend's write completes by itself (never one that waits for the target). The I/O
thread busy-polls for at most ``config.loop_spin_s`` after an event or a posted
recv, and only while a send or recv is outstanding; an idle agent uses no CPU.
"""
from __future__ import annotations

import uuid

from ..config import AgentConfig
from ..errors import KVXferError, RegistrationError
from ..kernels.device import device_for
from ..lease import LeaseTable
from ..metrics import Metrics
from ..net import listen as listen_socket, split_address
from ..secrets import normalize_secret
from ..timeouts import check_timeout
from ..transport.paths import CostModel
from .io_loop import IOLoop
from .peers import Connections, Peer
from .pool import register_pool
from .protocol import Msg
from .receiver import Notifications, Receiver
from .sender import Sender
from .state import AgentState
from .threads import BackendDriver

__all__ = ["Agent", "AgentConfig", "Peer"]


class Agent:
    """``Agent(name, listen="127.0.0.1:0", *, secret, backend="auto", config=None,
    on_release=None, device=None)``.

    ``secret`` (bytes/str, >= 16 bytes, required): shared by every agent of a deployment;
    it never leaves the process. ``config``: an :class:`~kvxfer.AgentConfig`, the one
    place every setting lives (staging size, path, lease timeout, cost model, limits,
    timeouts, transport knobs); None means the defaults, ``AgentConfig()``. The agent
    reads no environment variable: an entry point that wants them passes
    ``AgentConfig.from_env(...)``. The other arguments are not settings but what the
    agent is wired to: ``backend`` (a name from :data:`kvxfer.transport.BACKENDS`, or a
    :class:`~kvxfer.transport.Backend` instance tests plug in), ``on_release(request_id,
    block_ids, reason)``: called once per lease when blocks may be reused (``reason`` in
    done, cancelled, failed, expired, closed); it runs on an agent thread, possibly with
    the agent's lock held, so it must be quick and must not wait on the agent (hand the
    ids to your scheduler's queue). ``device``: where pack/unpack run and how their
    completion is awaited (a :class:`kvxfer.kernels.device.Device`; default: the
    pool's, chosen at :meth:`register_kv`; tests plug in a deferred one).
    """

    def __init__(self, name: str, listen: str = "127.0.0.1:0", *, secret, backend="auto",
                 config: AgentConfig | None = None, on_release=None, device=None) -> None:
        if config is None:
            config = AgentConfig()
        elif not isinstance(config, AgentConfig):
            raise TypeError(f"config must be an AgentConfig, got {type(config).__name__}")
        self.name = str(name)
        self.agent_id = uuid.uuid4().hex
        self.metrics = Metrics(self.name)
        self.leases = LeaseTable(config.lease_timeout, on_release)
        secret = normalize_secret(secret)
        host, _ = split_address(listen)
        back = _make_backend(backend, host, config)
        caps = back.capabilities()
        self.metrics.info["backend"] = caps.name
        # Backends quote their per-descriptor cost for large runs; for runs of a few hundred
        # bytes process_vm_writev measured ~0.75 us each (Llama-3-8B NHD->HND, 1M runs), so
        # that is the floor the zero-copy vs pack choice uses.
        cost = config.cost_model or CostModel(per_desc_us=max(caps.per_desc_overhead_us, 0.75))
        self._state = s = AgentState(self.name, self.agent_id, config, back, self.metrics, self.leases, cost,
                                     device=device)
        try:
            lsock, self.address = listen_socket(listen)
        except OSError:
            back.close()
            raise
        self._sender = Sender(s)
        self._receiver = Receiver(s)
        self._notes = Notifications(s)
        self._driver = BackendDriver(s, self._receiver.busy)
        self._conns = Connections(s, secret, self._handlers(), self._receiver.post_pending,
                                  self._peer_lost, self._driver, self._malformed_handlers())
        s.loop = IOLoop(lsock, self._conns.on_accept, self.name, spin_s=config.loop_spin_s,
                        spin_if=self._spin_if)
        self._driver.start()

    def _spin_if(self) -> bool:
        """Whether the I/O loop may poll: a transfer is outstanding (a peer's message comes
        soon) and no bulk copy wants the cores (neither component's worker has a job, no
        pending recv is one a sender's copy pool moves); read without the lock (a hint)."""
        sender, receiver = self._sender, self._receiver
        if sender.copying() or receiver.copying():
            return False
        return sender.outstanding() or receiver.outstanding()

    def _handlers(self) -> dict:
        """The dispatch table: each message to the component that owns it."""
        sender, receiver = self._sender, self._receiver
        to_sender, to_receiver = sender.posts.on_cancel, receiver.on_sender_cancel

        def cancel(peer, f) -> None:  # CANCEL / FAIL: to_sender says which side it is for
            (to_sender if f["to_sender"] else to_receiver)(peer, f)

        return {**sender.handlers(), **receiver.handlers(), **self._notes.handlers(),
                Msg.CANCEL: cancel, Msg.FAIL: cancel}

    def _malformed_handlers(self) -> dict:
        """Per-request messages whose payload did not decode: each fails the request it names."""
        piece = self._receiver.on_malformed
        return {Msg.RECV_POST: self._sender.on_malformed_post, Msg.MATCHED: piece, Msg.DATA_DONE: piece}

    def _peer_lost(self, peer: Peer, err) -> None:
        self._sender.peer_lost(peer, err)
        self._receiver.peer_lost(peer, err)

    @property
    def config(self) -> AgentConfig:
        return self._state.config

    # ---- registration ---------------------------------------------------------------
    def register_kv(self, layout) -> None:
        """Register the pool of ``layout`` (a :class:`~kvxfer.KVLayout`) and the staging
        buffers, once, before :meth:`connect`. Raises :class:`RegistrationError` on failure."""
        s = self._state
        with s.lock:
            s.check_open()
            if s.pool is not None:
                raise RegistrationError("register_kv was already called on this agent")
            if s.peers:
                raise RegistrationError("register_kv must come before connecting peers")
            device = s.device if s.device is not None else device_for(layout)
            pool = register_pool(s, layout, device)
            s.device = device
            s.pool = pool

    # ---- connections ----------------------------------------------------------------
    def connect(self, address: str, *, timeout: float | None = None) -> Peer:
        """Connect and authenticate (``timeout``: default ``config.handshake_timeout``);
        raises AuthenticationError, LayoutMismatch, ProtocolError, ConnectionRefused (the
        peer is busy with other handshakes or refuses this address for now: retry
        later), PeerDisconnected (unreachable) or TransferTimeout."""
        timeout = check_timeout(timeout)
        return self._conns.connect(address, self.config.handshake_timeout if timeout is None else timeout)

    def peers(self) -> list:
        """Every connected peer (those we connected to and those that connected to us)."""
        return self._conns.connected()

    def disconnect(self, peer: Peer) -> None:
        """Close the control connection; that peer's pending transfers fail with PeerDisconnected."""
        self._conns.disconnect(peer)

    # ---- transfers (P side) ------------------------------------------------------------
    def send(self, peer, request_id: str, block_ids, *, layers=None, lease_timeout: float | None = None,
             after=None):
        """Ship ``block_ids`` (this pool) of ``request_id`` to whichever blocks ``peer``'s
        recv names. ``layers``: None = every layer the receiver asks for. Async: returns a
        :class:`TransferHandle` done when the data is visible in the receiver's blocks.
        The blocks stay leased until then (or cancel / failure / lease expiry).

        ``peer=None``: whichever connected peer posts a recv for ``request_id`` first
        (before or after this call) receives it; ``handle.peer`` names it once matched.
        A receiver that holds a prefix already (``recv(..., skip_blocks=k)``) gets only
        ``block_ids[k:]``; the lease covers all of ``block_ids`` either way.

        ``after``: the producer of these blocks' KV on a CUDA pool, a ``torch.cuda.Event``
        or ``torch.cuda.Stream`` (an event is recorded on it now): nothing reads the pool
        before it completed (zero-copy: the host waits for it before posting; pack:
        kvxfer's stream waits for it on the GPU). None: the KV must already be written.

        Raises at the call, having posted and leased nothing: ValueError/TypeError for
        bad arguments (block ids, request id, ``lease_timeout``: docs/api.md,
        "Arguments"), :class:`~kvxfer.errors.BlocksBusy` if a pending recv of this agent
        holds one of ``block_ids`` (other sends may share them), KVXferError once closed."""
        return self._sender.send(peer, request_id, block_ids, layers=layers, lease_timeout=lease_timeout,
                                 after=after)

    def send_layer(self, peer, request_id: str, layer: int, block_ids, *, lease_timeout: float | None = None,
                   after=None):
        """Stream one finished layer; the first call opens the stream. Every call returns the
        same handle, done once every layer the receiver asked for has landed. ``after``: as
        for :meth:`send`, the event (or stream) that writes this layer's KV."""
        return self._sender.send_layer(peer, request_id, layer, block_ids, lease_timeout=lease_timeout,
                                       after=after)

    def write(self, peer, local_ids, remote_ids, *, layers=None, notify: bytes | None = None):
        """One-sided: copy local blocks into the peer's ``remote_ids`` (all heads both hold).
        ``notify`` reaches ``peer.notifications()`` after the data is visible there."""
        return self._sender.write(peer, local_ids, remote_ids, layers=layers, notify=notify)

    def read(self, peer, local_ids, remote_ids, *, layers=None):
        """One-sided: copy the peer's ``remote_ids`` into local blocks (zero-copy descriptors)."""
        return self._sender.read(peer, local_ids, remote_ids, layers=layers)

    def pending_recvs(self) -> list:
        """``[(peer, request_id, num_blocks), ...]``: recvs connected peers posted that no
        send of ours matched yet (``num_blocks`` counts the sender's blocks, skipped ones too)."""
        return self._sender.pending_recvs()

    # ---- transfers (D side) ------------------------------------------------------------
    def recv(self, request_id: str, block_ids, *, layers=None, timeout: float | None = None,
             skip_blocks: int = 0):
        """Receive ``request_id`` into ``block_ids`` of this pool (this rank's kv heads).

        ``skip_blocks``: this side already holds the first ``skip_blocks`` of the
        sender's blocks (e.g. a prefix found in its own prefix cache); ``block_ids``
        receive the sender's blocks ``[skip_blocks:]``, so the sender names all of
        its blocks and the receiver only the tail: ``skip_blocks + len(block_ids)``
        must equal the sender's count, or the transfer fails with ``InvalidDescriptor``.

        Async: returns a :class:`TransferHandle`; ``wait()`` returns once every
        requested layer is visible in these blocks, ``wait(layer=l)`` once layer
        ``l`` is. ``timeout`` (default: the lease timeout) fails the handle with
        :class:`TransferTimeout`; the blocks are released (``on_release``) only
        once no peer can still write into them.

        Raises at the call, having posted and leased nothing: ValueError/TypeError for
        bad arguments (block ids must be distinct integers, a request id of at most 256
        characters, a finite ``timeout`` > 0: docs/api.md, "Arguments"),
        :class:`~kvxfer.errors.BlocksBusy` if another pending transfer of this agent
        holds one of ``block_ids``, KVXferError once closed.
        """
        return self._receiver.recv(request_id, block_ids, layers=layers, timeout=timeout,
                                   skip_blocks=skip_blocks)

    def notifications(self) -> list:
        """Drain and return ``[(peer, bytes), ...]`` received since the last call, in order.
        Undrained notifications count against their peer's limits (``docs/api.md``)."""
        return self._notes.drain()

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._state.closed

    def held_blocks(self) -> dict:
        """``{request_id: block_ids}`` still lent to in-flight transfers (see :mod:`kvxfer.lease`)."""
        return self.leases.held()

    def close(self) -> None:
        """Fail pending handles, stop the threads, close the backend (every registration and
        endpoint), release every remaining lease ("closed"), free the staging buffers.

        Every step runs even when an earlier one fails; the first failure is raised after
        the last step (a :class:`KVXferError`; later ones are attached as notes). A second
        call returns at once. Once it returned, every handle this agent gave out is final
        (also one from a send/recv that raced it) and every later call raises KVXferError.
        """
        s = self._state
        with s.lock:
            if s.closed:
                return
            s.closed = True
        err = KVXferError(f"agent {self.name!r} closed")
        failures: list = []

        def step(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - collected and raised below
                failures.append(exc)

        step(self._sender.close, err)
        step(self._receiver.close, err)
        if s.pool is not None:
            step(s.pool.stage_out.close)
            step(s.pool.stage_in.close)
        step(s.loop.stop)
        step(self._sender.stop)
        step(self._receiver.stop)
        if s.device is not None:  # nothing it launched still touches the staging buffers or the pool
            step(s.device.close)
        for peer in list(s.peers.values()):  # their pools mapped here (the others were unmapped as they left)
            step(peer.link.close)
        # Closing the backend releases every registration, cancels what is still in
        # flight (a timed-out transfer) and ends every endpoint, so no peer can write
        # into a block whose lease ends below.
        step(s.backend.close)
        for key in self.leases.keys():
            step(self.leases.release, key, "closed")
        # drop the pool (staging tensors, layout) now rather than by the cycle collector
        s.pool = None
        s.peers.clear()
        self._notes.clear()
        if failures:
            first = failures[0]
            if not isinstance(first, KVXferError):
                first = KVXferError(f"closing agent {self.name!r} failed: {first!r}").with_traceback(
                    first.__traceback__)
            for other in failures[1:]:
                first.add_note(f"also failed while closing: {other!r}")
            raise first

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._state
        state = "closed" if s.closed else f"{len(s.peers)} peers"
        return f"<Agent {self.name!r} {self.address} {state} backend={self.metrics.info.get('backend')}>"


def _make_backend(spec, listen_host: str, config: AgentConfig):
    """The agent's backend: ``spec`` itself if it is one, else built by name with the
    config's transport knobs, narrowed to the devices holding ``listen_host``."""
    from ..transport import make_backend
    from ..transport.base import Backend

    if isinstance(spec, Backend) or spec == "loopback":
        return make_backend(spec)
    return make_backend(spec, listen_host=listen_host, config=config)
