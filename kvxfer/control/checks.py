"""Checks of what a peer says about a transfer, and typed failures on the wire.

The schema (:mod:`~kvxfer.control.messages`) only guarantees types; here every
peer-supplied number is checked against what *this* agent knows before any of
it is used: a RECV_POST against D's advertised geometry (P side), a DATA_DONE
against D's own request (D side). A failed check fails that one request on
both sides -- the other side learns why from a FAIL message whose ``code``
names the error class -- and never a thread or another request.
"""
from __future__ import annotations

from ..errors import InvalidDescriptor, KVXferError, LayoutMismatch, LimitExceeded, ProtocolError

# FAIL.code -> the error class the other side's handle fails with
CODES = {"invalid": InvalidDescriptor, "protocol": ProtocolError, "layout": LayoutMismatch,
         "limit": LimitExceeded}


def code_of(error: BaseException) -> str | None:
    """The FAIL code of ``error``, or None if the other side is told with a plain CANCEL."""
    for code, cls in CODES.items():
        if type(error) is cls:
            return code
    return None


def error_from(f: dict, who: str) -> KVXferError:
    """The typed error a received FAIL (``f``: code, reason) stands for."""
    cls = CODES.get(f["code"], ProtocolError)
    return cls(f"{who} failed {f['req']!r}: {f['reason']}")


def _distinct_below(values, bound: int) -> bool:
    return bool(values) and len(set(values)) == len(values) and max(values) < bound


def check_post(geometry, num_layers: int, f: dict) -> None:
    """A RECV_POST from the peer of ``geometry`` (its advertised pool); ``num_layers`` of ours.
    Raises InvalidDescriptor naming the first bad field."""
    if geometry is None:
        raise InvalidDescriptor("RECV_POST from a peer that registered no KV pool")
    if not f["req"]:
        raise InvalidDescriptor("RECV_POST with an empty request id")
    if not _distinct_below(f["blocks"], geometry.num_blocks):
        raise InvalidDescriptor(f"RECV_POST blocks must be distinct and below {geometry.num_blocks}")
    if not _distinct_below(f["layers"], min(num_layers, geometry.num_layers)):
        raise InvalidDescriptor(f"RECV_POST layers must be distinct and below {num_layers}")
    if tuple(f["heads"]) != geometry.head_range:
        raise InvalidDescriptor(f"RECV_POST heads {tuple(f['heads'])} are not the peer's {geometry.head_range}")


def check_piece(op, layout, peer, f: dict):
    """A DATA_DONE for recv ``op`` from ``peer``, against what ``op`` asked for.

    Returns the positions of its blocks in the request (None: all of them, the
    zero-copy case). Raises ProtocolError (wrong peer) or InvalidDescriptor.
    """
    if peer not in op.matched:
        raise ProtocolError(f"DATA_DONE for {op.req!r} from {peer.name!r}, which never matched it")
    layers, heads = f["layers"], tuple(f["heads"])
    distinct = set(layers)
    if not layers or len(distinct) != len(layers) or not distinct <= op.coverage.layers:
        raise InvalidDescriptor(f"DATA_DONE layers {layers[:8]} are not part of {op.req!r}")
    theirs = peer.geometry.head_range if peer.geometry is not None else (0, 0)
    if not (max(op.heads[0], theirs[0]) <= heads[0] < heads[1] <= min(op.heads[1], theirs[1])):
        raise InvalidDescriptor(f"DATA_DONE heads {heads} outside {op.heads} and the sender's {theirs}")
    if f["pack"]:
        pos = op.coverage.positions(f["blocks"])
        if pos is None:
            raise InvalidDescriptor(f"DATA_DONE names blocks that are not (distinct) blocks of {op.req!r}")
        nblocks = len(pos)
    else:
        if f["blocks"]:
            raise InvalidDescriptor("a zero-copy DATA_DONE covers the whole request and names no blocks")
        pos, nblocks = None, len(op.blocks)
    # = layout.wire_nbytes(nblocks, layers, heads): the layers are distinct layers of op,
    # i.e. already resolved against this layout, so they need no second resolution
    if len(layers) * nblocks * layout.block_nbytes(heads) != f["nbytes"]:
        raise InvalidDescriptor(f"DATA_DONE of {f['nbytes']} B does not match its blocks, layers and heads")
    return pos


def check_chunk_shape(layout, f: dict) -> None:
    """A pack chunk with no request (one-sided write): inside this pool, sized right."""
    blocks, layers, heads = f["blocks"], f["layers"], tuple(f["heads"])
    own = layout.head_range
    if (not _distinct_below(blocks, layout.num_blocks) or not _distinct_below(layers, layout.num_layers)
            or not own[0] <= heads[0] < heads[1] <= own[1]
            or layout.wire_nbytes(len(blocks), layers, heads) != f["nbytes"]):
        raise InvalidDescriptor("pack chunk outside this pool or of the wrong size")
