"""The agent stage: ``kvxfer.Agent`` and what it is built from, one module per noun.

- :mod:`.agent`: the facade (construct, register, connect, send/recv/write/read, close);
- :mod:`.state`: what the components share, and the in-flight records;
- :mod:`.protocol`: the message vocabulary (schemas, binary payloads, FAIL codes; the
  handshake's messages, proofs and admission are :mod:`kvxfer.auth`'s);
- :mod:`.io_loop`: the I/O thread and its buffered control connections;
- :mod:`.peers`: peers, connect / accept / dispatch, per-peer books;
- :mod:`.pool`: the registered pool, its region parts and staging rings;
- :mod:`.sender` / :mod:`.receiver`: the P side and D side state machines;
- :mod:`.datapath`: where the bytes move (path choice, zero-copy write, pack);
- :mod:`.threads`: the FIFO worker thread and the backend driver.

Only :class:`Agent` and :class:`Peer` (re-exported by :mod:`kvxfer`) are public.
"""
from .agent import Agent, AgentConfig, Peer

__all__ = ["Agent", "AgentConfig", "Peer"]
