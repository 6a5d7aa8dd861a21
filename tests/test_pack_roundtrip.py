"""Pack on one engine layout, unpack on another: the wire format is the contract."""
import pytest
import torch

import kvxfer
from pack_cases import H, make

PAIRS = [("vllm", "flashinfer_hnd"), ("flashinfer_kv_pair", "cross_layer_blocks_outer"),
         ("sglang", "vllm_hnd_strides"), ("cross_layer_layers_outer", "padded_rows"), ("strided_dim", "pool_views")]


def _blocks_equal(a, a_ids, b, b_ids, heads_a=None, heads_b=None):
    for layer in range(a.num_layers):
        for kv in range(a.num_kv):
            x = a.kv_view(layer, kv)[a_ids]
            y = b.kv_view(layer, kv)[b_ids]
            if heads_a:
                x = x[:, :, heads_a[0]:heads_a[1]]
            if heads_b:
                y = y[:, :, heads_b[0]:heads_b[1]]
            if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                return False
    return True


@pytest.mark.parametrize("src_kind,dst_kind", PAIRS)
def test_roundtrip_between_layouts(src_kind, dst_kind):
    src, dst = make(src_kind, seed=1), make(dst_kind, seed=2)
    assert src.fingerprint() == dst.fingerprint()
    wire = kvxfer.pack(src, [6, 0, 3])
    kvxfer.unpack(dst, wire, [1, 2, 5])
    assert _blocks_equal(src, [6, 0, 3], dst, [1, 2, 5])
    assert torch.equal(kvxfer.pack(dst, [1, 2, 5]), wire)


def test_tp2_halves_into_tp1_whole():
    full = make("vllm", seed=5)
    ranks = [make("flashinfer_hnd", seed=6 + r, heads=H // 2, tp_rank=r, tp_size=2) for r in range(2)]
    for r, rank in enumerate(ranks):
        assert rank.head_range == (r * H // 2, (r + 1) * H // 2)
        assert full.head_overlap(rank) == rank.head_range
        kvxfer.unpack(full, kvxfer.pack(rank, [4, 1]), [0, 3], heads=rank.head_range)
    lo, hi = ranks[0].head_range, ranks[1].head_range
    assert _blocks_equal(ranks[0], [4, 1], full, [0, 3], heads_b=lo)
    assert _blocks_equal(ranks[1], [4, 1], full, [0, 3], heads_b=hi)


def test_tp1_whole_into_tp2_halves():
    full = make("cross_layer_blocks_outer", seed=7)
    ranks = [make("sglang", seed=8 + r, heads=H // 2, tp_rank=r, tp_size=2) for r in range(2)]
    for rank in ranks:
        kvxfer.unpack(rank, kvxfer.pack(full, [2, 5], heads=rank.head_range), [6, 0])
        lo, hi = rank.head_range
        assert _blocks_equal(full, [2, 5], rank, [6, 0], heads_a=(lo, hi))


def test_layerwise_streaming_slots_are_contiguous_slices():
    src, dst = make("cross_layer_blocks_outer", seed=1), make("vllm", seed=2)
    ids = [3, 0, 6]
    whole = kvxfer.pack(src, ids)
    per_layer = src.wire_nbytes(len(ids), layers=[0])
    for layer in range(src.num_layers):
        part = kvxfer.pack(src, ids, layers=[layer])
        assert torch.equal(part, whole[layer * per_layer:(layer + 1) * per_layer])
        kvxfer.unpack(dst, part, [1, 2, 4], layers=layer)
    assert _blocks_equal(src, ids, dst, [1, 2, 4])
