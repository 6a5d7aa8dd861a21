"""Chained content keys for KV blocks: ``block_keys(token_ids, block_size, salt)``.

Key ``i`` names block ``i`` of a prompt *including everything before it*: it is
BLAKE2b-256 over key ``i-1`` and the ``block_size`` token ids of block ``i``
(little-endian uint32), and key ``-1`` is a root digest of the salt and the
block size. Two prompts share key ``i`` exactly when they share their first
``(i + 1) * block_size`` tokens (and the salt), so a pool lookup of a prompt's
keys in order finds its longest cached prefix. Only full blocks get a key; the
tail past the last full block has none (it is never pooled).

The salt carries the model identity (weights digest, dtype, layer and head
counts, block size): KV computed by another model must never match. The keys
depend on nothing else, so every process on every host computes the same
ones (no per-process hash seed, never Python's ``hash()``).
"""
from __future__ import annotations

import hashlib

__all__ = ["block_keys", "extend_keys", "check_keys", "KEY_BYTES", "MAX_KEY_BYTES"]

KEY_BYTES = 32  # what block_keys makes
MAX_KEY_BYTES = 64  # the longest key a store accepts
_DOMAIN = b"kvxfer-block-keys-v1"
_MAX_TOKEN = 2**32


def _token_bytes(token_ids) -> bytes:
    import numpy as np

    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # torch.Tensor
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-d, got shape {list(arr.shape)}")
    if arr.size == 0:
        return b""
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= _MAX_TOKEN:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def block_keys(token_ids, block_size: int, salt: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of ``token_ids``: ``len(token_ids) // block_size`` keys of
    :data:`KEY_BYTES` bytes each.

    ``token_ids``: ``[num_tokens]`` ints in ``[0, 2**32)`` (sequence, numpy array or
    tensor); ``block_size``: tokens per block (>= 1); ``salt``: bytes naming the model
    (see the module docstring). Raises ``TypeError``/``ValueError`` for bad arguments.
    """
    return _chain(_root(block_size, salt), _token_bytes(token_ids), block_size)


def extend_keys(keys: list[bytes], token_ids, block_size: int, salt: bytes = b"") -> list[bytes]:
    """``keys`` continued over the full blocks of ``token_ids`` past them: the same list as
    ``block_keys(token_ids, block_size, salt)`` when ``keys`` are that call's first
    ``len(keys)`` keys (a sequence that grew, e.g. by generated tokens), hashing only the
    new blocks. Returns a new list; ``keys`` itself if no block is new. ``salt`` roots the
    chain when ``keys`` is empty (the chain goes on from ``keys[-1]`` otherwise). Arguments
    and errors as :func:`block_keys`; ``keys`` are not checked against ``token_ids``."""
    root = _root(block_size, salt)
    n, full = len(keys), len(token_ids) // block_size
    if full <= n:
        return keys
    data = _token_bytes(token_ids[n * block_size:full * block_size])
    return list(keys) + _chain(keys[-1] if keys else root, data, block_size)


def _root(block_size: int, salt) -> bytes:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if isinstance(salt, str) or not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    return hashlib.blake2b(_DOMAIN + len(salt).to_bytes(8, "little") + bytes(salt)
                           + block_size.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def _chain(prev: bytes, data: bytes, block_size: int) -> list[bytes]:
    """The keys of ``data``'s full blocks (``4 * block_size`` bytes each) after key ``prev``."""
    step = 4 * block_size
    keys = []
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[start:start + step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def check_keys(keys) -> list:
    """``keys`` as a list of ``bytes`` of 1..:data:`MAX_KEY_BYTES` each (a client's
    argument check); ``TypeError`` / ``ValueError`` otherwise."""
    from .._native import load

    if isinstance(keys, (bytes, str)):
        raise TypeError("keys must be a sequence of bytes (e.g. kvxfer.block_keys(...))")
    out = list(keys)
    if load().keys_ok(out, MAX_KEY_BYTES):  # the common case, checked natively
        return out
    for k in out:
        if not isinstance(k, (bytes, bytearray)):
            raise TypeError(f"keys must be bytes, got {type(k).__name__}")
        if not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"a key must be 1..{MAX_KEY_BYTES} bytes, got {len(k)}")
    return [bytes(k) for k in out]
