"""kvxfer.block_keys: chained content keys, the same in every process."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvxfer


def test_chained_full_blocks_only():
    toks = list(range(100))
    keys = kvxfer.block_keys(toks, 16, salt=b"model-a")
    assert len(keys) == 6 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert len(set(keys)) == 6
    # a shared prefix shares exactly the keys of its full blocks
    other = toks[:40] + [7] * 60
    k2 = kvxfer.block_keys(other, 16, salt=b"model-a")
    assert k2[:2] == keys[:2] and k2[2] != keys[2]
    # key i covers every token up to the end of block i: a change in block 0 changes all
    changed = [1] + toks[1:]
    assert not set(kvxfer.block_keys(changed, 16, salt=b"model-a")) & set(keys)
    # the same block content after a different prefix is a different key
    assert kvxfer.block_keys(toks[16:32], 16, salt=b"model-a")[0] != keys[1]
    assert kvxfer.block_keys(toks[:15], 16) == []


def test_salt_and_block_size_separate_models():
    toks = list(range(64))
    a = kvxfer.block_keys(toks, 16, salt=b"model-a")
    assert not set(a) & set(kvxfer.block_keys(toks, 16, salt=b"model-b"))
    assert not set(a) & set(kvxfer.block_keys(toks, 16))
    assert not set(kvxfer.block_keys(toks, 8, salt=b"model-a")) & set(a)


def test_input_kinds_agree():
    toks = [5, 1, 99999, 3] * 8
    ref = kvxfer.block_keys(toks, 4, salt=b"s")
    assert kvxfer.block_keys(np.array(toks, dtype=np.int32), 4, salt=b"s") == ref
    assert kvxfer.block_keys(torch.tensor(toks), 4, salt=bytearray(b"s")) == ref
    assert kvxfer.block_keys(tuple(toks), 4, salt=memoryview(b"s")) == ref


def test_deterministic_across_processes():
    """Never Python's hash(): another interpreter with another hash seed gets the same keys."""
    code = ("import kvxfer,sys; sys.stdout.write(b''.join(kvxfer.block_keys(list(range(50)), 8, "
            "salt=b'm')).hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == b"".join(kvxfer.block_keys(list(range(50)), 8, salt=b"m")).hex()


@pytest.mark.parametrize("args, exc", [
    (([1, 2], 0), ValueError), (([1, 2], 1.5), TypeError), (([1, -1], 1), ValueError),
    (([2**32], 1), ValueError), (([1.0, 2.0], 1), TypeError), (([[1, 2]], 1), ValueError),
    (([1, 2], True), TypeError), (([1, 2], 1, "salt"), TypeError),
])
def test_bad_arguments(args, exc):
    with pytest.raises(exc):
        kvxfer.block_keys(*args)


def test_extend_keys_continues_the_chain_as_a_sequence_grows():
    from kvxfer.store import extend_keys

    toks = [(7 * i) % 5000 for i in range(230)]
    whole = kvxfer.block_keys(toks, 16, salt=b"m")
    for known in (0, 1, 5, len(whole)):  # a prompt's keys, then its generated tokens' blocks
        keys = whole[:known]
        grown = extend_keys(keys, toks, 16, salt=b"m")
        assert grown == whole and keys == whole[:known]  # a new list; the given one is kept
    assert extend_keys(whole, toks[:40], 16, salt=b"m") is whole  # nothing new to hash
    assert extend_keys(whole[:2], toks, 16, salt=b"other") == whole  # the salt roots the chain only from empty
    assert extend_keys([], toks, 16, salt=b"other") == kvxfer.block_keys(toks, 16, salt=b"other")
    with pytest.raises(TypeError):
        extend_keys([], toks, 16, salt="m")
    with pytest.raises(ValueError):
        extend_keys([], [1, -1] * 8, 1)
