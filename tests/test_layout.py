"""KVLayout: dims parsing, sizes, fingerprints, regions and byte runs."""
import ctypes

import numpy as np
import pytest
import torch

import kvxfer
from kvxfer.errors import LayoutMismatch
from kvxfer.layout import KVLayout
from kvxfer.transport.descriptors import Geometry, count_runs, zero_copy_descs
from pack_cases import B, D, H, KINDS, L, N, make


def test_sizes_and_wire_geometry():
    layout = make("vllm", tp_rank=1, tp_size=2)
    assert (layout.num_layers, layout.num_kv, layout.num_blocks, layout.block_size) == (L, 2, N, B)
    assert (layout.num_heads, layout.num_global_heads, layout.head_range) == (H, 2 * H, (H, 2 * H))
    assert (layout.head_dim, layout.dtype, layout.itemsize, layout.device.type) == (D, torch.bfloat16, 2, "cpu")
    assert layout.block_nbytes() == 2 * B * H * D * 2
    assert layout.block_nbytes(heads=(H, H + 1)) == 2 * B * D * 2
    assert layout.wire_shape(5, layers=[1]) == (1, 2, 5, B, H, D)
    assert layout.wire_nbytes(5) == L * 5 * layout.block_nbytes()


def test_mla_layout():
    layout = make("mla")
    assert layout.is_mla and layout.num_kv == 1 and layout.head_dim == 2 * D and layout.head_range == (0, 1)
    assert layout.block_nbytes() == B * 2 * D * 2


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_same_model_fingerprint(kind):
    layout = make(kind)
    if kind == "mla":
        assert "kv=1" in layout.fingerprint()
    else:
        assert layout.fingerprint() == make("vllm").fingerprint()


def test_fingerprint_ignores_tp_split_but_not_model_dims():
    whole, half = make("vllm"), make("sglang", heads=H // 2, tp_rank=1, tp_size=2)
    assert whole.compatible_with(half) and whole.compatible_with(half.fingerprint())
    assert whole.head_overlap(half) == (H // 2, H)
    assert make("vllm", heads=H // 2, tp_rank=0, tp_size=2).head_overlap(half) is None
    with pytest.raises(LayoutMismatch, match="block"):
        whole.check_compatible(make("vllm", bs=B + 1))
    with pytest.raises(LayoutMismatch, match="dtype"):
        whole.check_compatible(make("vllm", dtype=torch.float16))
    assert not whole.compatible_with(make("vllm", layers=L + 1))


def test_regions():
    assert len(make("cross_layer_blocks_outer").regions()) == 1
    assert len(make("pool_views").regions()) == 1  # views of one storage: one registration
    per_layer = make("flashinfer_kv_pair")
    spans = per_layer.regions()
    assert len(spans) == 2 * L
    assert sum(n for _, n in spans) == sum(t.numel() * t.element_size() for t in per_layer.tensors)


def _read(layout, region, offset, length):
    addr, size = layout.regions()[region]
    assert 0 <= offset and offset + length <= size
    return ctypes.string_at(addr + offset, length)


@pytest.mark.parametrize("kind", KINDS)
def test_block_runs_cover_the_wire_bytes(kind):
    layout = make(kind)
    heads = None if layout.is_mla else (1, 3)
    for ids, layers in (([5, 0, 1, 2], None), ([3], [2, 0])):
        runs = layout.block_runs(ids, layers=layers, heads=heads)
        wire = kvxfer.pack(layout, ids, layers=layers, heads=heads, backend="reference").numpy().tobytes()
        assert runs.dtype == np.int64 and runs.shape[1] == 4
        assert runs[:, 3].sum() == len(wire) and runs[0, 2] == 0
        assert np.array_equal(runs[1:, 2], runs[:-1, 2] + runs[:-1, 3])
        for region, offset, wire_offset, length in runs.tolist():
            assert _read(layout, region, offset, length) == wire[wire_offset:wire_offset + length]


def test_block_runs_coalesce_adjacent_blocks():
    layout = make("cross_layer_layers_outer")
    assert len(layout.block_runs([1, 2, 3])) == L * 2  # one run per (layer, kv)
    # HND pool, NHD wire: rows of D; only K's last row and V's first row of a layer touch
    assert len(make("vllm_hnd_strides").block_runs([1])) == L * 2 * B * H - L


@pytest.mark.parametrize("src_kind,dst_kind", [("cross_layer_blocks_outer", "cross_layer_blocks_outer"),
                                               ("vllm", "flashinfer_hnd"), ("sglang", "padded_rows")])
def test_zero_copy_descs_move_blocks_between_layout_kinds(src_kind, dst_kind):
    src, dst = make(src_kind, seed=1), make(dst_kind, seed=2)
    gs, gd = Geometry.from_layout(src), Geometry.from_layout(dst)
    desc = zero_copy_descs(gs, [4, 5, 1], gd, [0, 1, 6], range(gs.num_layers), gs.head_range,
                           list(range(len(gs.region_sizes))), list(range(len(gd.region_sizes))))
    src_regions, dst_regions = src.regions(), dst.regions()
    for s_reg, s_off, d_reg, d_off, length in desc.tolist():
        ctypes.memmove(dst_regions[d_reg][0] + d_off, src_regions[s_reg][0] + s_off, length)
    assert torch.equal(kvxfer.pack(dst, [0, 1, 6]), kvxfer.pack(src, [4, 5, 1]))
    assert len(desc) <= count_runs(gs, gd, 3, range(gs.num_layers), gs.head_range)


def test_explicit_kv_forms_agree():
    k = [torch.randn(N, B, H, D) for _ in range(L)]
    v = [torch.randn(N, B, H, D) for _ in range(L)]
    a = KVLayout.from_tensors((k, v), "N B H D")
    b = KVLayout.from_tensors({"k": k, "v": v}, "NBHD")
    assert torch.equal(kvxfer.pack(a, [1, 2]), kvxfer.pack(b, [1, 2]))
    assert a.kv_view(1, 1) is not None and torch.equal(a.kv_view(1, 1), v[1])


@pytest.mark.parametrize("tensors,dims,exc,match", [
    (lambda: (torch.zeros(2, N, B, H, D),) * 2, "N B H D", ValueError, "names 4 dimensions"),
    (lambda: torch.zeros(2, N, B, H, D), "2 N B H", ValueError, "need 'H' and 'D'"),
    (lambda: torch.zeros(2, N, B, H, D), "2 N B H X", ValueError, "unknown dim"),
    (lambda: torch.zeros(2, N, B, H, D), "2 N N H D", ValueError, "repeated"),
    (lambda: torch.zeros(N, B, H, D), "N B H D", TypeError, r"\(k, v\) pair"),
    (lambda: (torch.zeros(N, B, H, D), torch.zeros(N, B, H, D + 1)), "N B H D", ValueError, "same shape"),
    (lambda: (torch.zeros(N, B, H, D), torch.zeros(N, B, H, D, dtype=torch.half)), "N B H D", TypeError, "dtype"),
    (lambda: torch.zeros(3, N, B, H, D), "2 N B H D", ValueError, "size 3"),
    (lambda: torch.zeros(N, B, H, D, dtype=torch.int32), "N B H D C", ValueError, "excludes"),
    (lambda: [torch.zeros(2, N, B, H, D, dtype=torch.int32)], "2 N B H D", TypeError, "not supported"),
    (lambda: torch.zeros(1, B, H, D).expand(N, B, H, D), "N B H D", TypeError, "pair"),
    (lambda: torch.zeros(2, 1, B, H, D).expand(2, N, B, H, D), "2 N B H D", ValueError, "stride 0"),
    (lambda: "nope", "2 N B H D", TypeError, "tensor"),
])
def test_from_tensors_rejects(tensors, dims, exc, match):
    with pytest.raises(exc, match=match):
        KVLayout.from_tensors(tensors(), dims)


def test_tp_arguments_validated():
    with pytest.raises(ValueError, match="tp_rank"):
        make("vllm", tp_rank=2, tp_size=2)
    with pytest.raises(TypeError, match="tp_size"):
        KVLayout.from_tensors(torch.zeros(2, N, B, H, D), "2 N B H D", tp_size=2.0)
