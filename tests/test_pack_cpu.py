"""CPU pack/unpack paths (C++ ``native`` and ``torch``) against the reference, bit for bit."""
import numpy as np
import pytest
import torch

import kvxfer
from pack_cases import DTYPES, KINDS, N, make, same_storage

BACKENDS = ("native", "torch")
IDS = {"ragged": [5, 0, 3], "single": [6], "empty": [], "all": list(range(N)), "consecutive": [2, 3, 4]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_matches_reference(kind, backend):
    layout = make(kind)
    for ids in IDS.values():
        want = kvxfer.pack(layout, ids, backend="reference")
        assert want.numel() == layout.wire_nbytes(len(ids))
        assert torch.equal(kvxfer.pack(layout, ids, backend=backend), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_matches_reference(kind, backend):
    got, want = make(kind, seed=1), make(kind, seed=1)
    for i, ids in enumerate(IDS.values()):
        wire = torch.randint(0, 256, (got.wire_nbytes(len(ids)),), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(i))
        kvxfer.unpack(got, wire, ids, backend=backend)
        kvxfer.unpack(want, wire, ids, backend="reference")
        assert same_storage(got, want), ids  # padding and other blocks untouched too


@pytest.mark.parametrize("kind", ["vllm", "flashinfer_hnd", "cross_layer_blocks_outer", "strided_dim", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_subsets_and_head_ranges(kind, backend):
    layout = make(kind)
    heads = [None] if layout.is_mla else [None, (1, 3), (0, 1), (3, 4)]
    for layers in (None, [2, 0], 1):
        for h in heads:
            want = kvxfer.pack(layout, [4, 1], layers=layers, heads=h, backend="reference")
            assert torch.equal(kvxfer.pack(layout, [4, 1], layers=layers, heads=h, backend=backend), want)
            back, ref = make(kind, seed=3), make(kind, seed=3)
            kvxfer.unpack(back, want, [0, 6], layers=layers, heads=h, backend=backend)
            kvxfer.unpack(ref, want, [0, 6], layers=layers, heads=h, backend="reference")
            assert same_storage(back, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["vllm", "vllm_hnd_strides", "padded_rows"])
def test_dtypes_bit_exact(dtype, kind):
    layout = make(kind, dtype=dtype)
    want = kvxfer.pack(layout, [3, 1, 6], backend="reference")
    for backend in BACKENDS:
        assert torch.equal(kvxfer.pack(layout, [3, 1, 6], backend=backend), want)
    # the wire holds the engine's own values: compare with a direct view
    first = layout.kv_view(0, 0)[3].reshape(-1).view(torch.uint8)
    assert torch.equal(want[: first.numel()], first)


def test_wire_order_is_layer_kv_block_token_head_dim():
    layout = make("vllm_hnd_strides")
    wire = kvxfer.pack(layout, [5, 2], layers=[2, 0], heads=(1, 3))
    arr = wire.view(layout.dtype).view(layout.wire_shape(2, layers=[2, 0], heads=(1, 3)))
    assert arr.shape == (2, 2, 2, 2, 2, 8)
    for j, layer in enumerate([2, 0]):
        for kv in range(2):
            for i, blk in enumerate([5, 2]):
                assert torch.equal(arr[j, kv, i].view(torch.int16),
                                   layout.kv_view(layer, kv)[blk, :, 1:3].view(torch.int16))


@pytest.mark.parametrize("ids", [np.array([4, 2], dtype=np.int32), torch.tensor([4, 2]), (4, 2),
                                 torch.tensor([4, 2], dtype=torch.int32), range(4, 1, -2)])
def test_block_id_forms(ids):
    layout = make("vllm")
    assert torch.equal(kvxfer.pack(layout, ids), kvxfer.pack(layout, [4, 2], backend="reference"))


def test_int_id_and_repeated_ids_in_pack():
    layout = make("vllm")
    assert torch.equal(kvxfer.pack(layout, 3), kvxfer.pack(layout, [3], backend="reference"))
    assert torch.equal(kvxfer.pack(layout, [2, 2]), kvxfer.pack(layout, [2, 2], backend="reference"))


def test_out_buffer_prefix_is_written_and_returned():
    layout = make("sglang")
    need = layout.wire_nbytes(2)
    out = torch.full((need + 100,), 7, dtype=torch.uint8)
    got = kvxfer.pack(layout, [1, 5], out=out)
    assert got.data_ptr() == out.data_ptr() and got.numel() == need
    assert torch.equal(got, kvxfer.pack(layout, [1, 5], backend="reference"))
    assert bool((out[need:] == 7).all())


def test_threads_split_large_copies():
    from kvxfer.kernels.cpu import native_copy
    from kvxfer.runs import tile_copy

    layout = make("cross_layer_layers_outer", blocks=64, bs=16, heads=8, hd=128)  # 2 MiB a layer-kv
    job = tile_copy(layout, list(range(63, -1, -1)))
    wire = torch.empty(job.nbytes, dtype=torch.uint8)
    native_copy(job, wire, to_wire=True, threads=3)
    assert torch.equal(wire, kvxfer.pack(layout, list(range(63, -1, -1)), backend="reference"))


@pytest.mark.parametrize("nbytes,threads,streaming", [(1, 1, False), (4099, 3, False), (4099, 2, True),
                                                      ((1 << 20) + 77, 2, True), (64, 4, True)])
def test_contiguous_copy_moves_every_byte(nbytes, threads, streaming):
    from kvxfer.kernels import contiguous_copy

    src = np.random.default_rng(nbytes).integers(0, 256, nbytes + 2, dtype=np.uint8)
    dst = np.zeros(nbytes + 2, dtype=np.uint8)
    copy = contiguous_copy(dst.ctypes.data + 1, src.ctypes.data + 1, nbytes, threads=threads, streaming=streaming)
    copy()
    assert np.array_equal(dst[1:-1], src[1:-1]) and dst[0] == 0 and dst[-1] == 0  # nothing outside


def test_contiguous_copy_rejects_bad_arguments():
    from kvxfer.kernels import contiguous_copy

    with pytest.raises(ValueError):
        contiguous_copy(4096, 4096, 0)
    with pytest.raises(ValueError):
        contiguous_copy(4096, 4096, 8, threads=0)
    with pytest.raises(TypeError):
        contiguous_copy(4096.0, 4096, 8)
