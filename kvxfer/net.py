"""Socket plumbing shared by every kvxfer listener and client: addresses, listening
sockets, an authenticated connection (:mod:`kvxfer.auth`'s client handshake), and the
open-file limit that bounds a listener's connections."""
from __future__ import annotations

import logging
import resource
import socket

from .auth import client_handshake
from .errors import KVXferError, PeerDisconnected, TransferTimeout

__all__ = ["split_address", "listen", "open_authenticated", "raise_fd_limit"]

log = logging.getLogger("kvxfer")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (an IPv6 host may be bracketed) as ``(host, port)``; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def listen(address: str, backlog: int = 128) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on ``address`` ("host:port", port 0: any) and its
    actual "host:port". It listens on that address only."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lsock = socket.socket(family, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        lsock.bind((host, port))
        lsock.listen(backlog)
    except OSError:
        lsock.close()
        raise
    lsock.setblocking(False)
    return lsock, f"{host}:{lsock.getsockname()[1]}"


def open_authenticated(address: str, secret: bytes, info: dict, check_info, timeout: float, *,
                       what: str = "") -> tuple[socket.socket, dict]:
    """Connect to ``address`` ("host:port") and run the client handshake (``info``: our
    INFO, ``check_info``: see :func:`~kvxfer.auth.client_handshake`); the blocking socket
    and the peer's INFO fields. Raises TransferTimeout, PeerDisconnected or the
    handshake's typed error, having closed the socket. ``what``: how errors name the peer
    (e.g. "store node ")."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise TransferTimeout(f"connecting to {what}{address} timed out") from None
    except OSError as exc:
        raise PeerDisconnected(f"cannot reach {what}{address}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, client_handshake(sock, secret, info, check_info, timeout)
    except socket.timeout:
        sock.close()
        raise TransferTimeout(f"handshake with {what}{address} timed out") from None
    except KVXferError:
        sock.close()
        raise
    except (ConnectionError, OSError) as exc:
        sock.close()
        raise PeerDisconnected(f"{what}{address} closed the connection during the handshake: {exc}") from None
    except BaseException:
        sock.close()
        raise


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; return the soft limit
    now (a listener bounds the connections it keeps by it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft
