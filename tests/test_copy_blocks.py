"""``kvxfer.kernels.copy_blocks``: pool to pool in one launch, against the reference.

Interpreter runs on tiny CPU pools for every pair of layout kinds (including TP splits
and head ranges), the argument checks, an sm_90 compile with 16-byte vectors, and the
same checks on CUDA pools where a GPU is present.
"""
import os
import re

import pytest
import torch

import kvxfer
from kvxfer.errors import LayoutMismatch
from kvxfer.kernels import copy_blocks

from pack_cases import make, same_storage

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU tensors run the Triton kernel only in the interpreter")
TINY = dict(layers=2, blocks=5, bs=2, heads=2, hd=4)
KINDS = ["vllm", "vllm_hnd_strides", "flashinfer_kv_pair", "cross_layer_blocks_outer", "cross_layer_layers_outer",
         "strided_dim", "padded_rows", "sglang", "pool_views"]


def check(src_kind, dst_kind, device="cpu", sizes=TINY, src_tp=(0, 1), dst_tp=(0, 1), n=3, dtype=torch.bfloat16):
    """``sizes["heads"]``: the model's kv heads, split over each side's TP ranks."""
    def pool(kind, seed, tp):
        return make(kind, dtype=dtype, seed=seed, tp_rank=tp[0], tp_size=tp[1], device=device,
                    **dict(sizes, heads=sizes["heads"] // tp[1]))

    src, got, want = pool(src_kind, 1, src_tp), pool(dst_kind, 2, dst_tp), pool(dst_kind, 2, dst_tp)
    g = torch.Generator().manual_seed(5)
    src_ids = torch.randint(0, sizes["blocks"], (n,), generator=g).tolist()  # repeats allowed
    dst_ids = torch.randperm(sizes["blocks"], generator=g)[:n].tolist()
    copy_blocks(src, src_ids, got, dst_ids, backend="triton")
    copy_blocks(src, src_ids, want, dst_ids, backend="reference")
    if device == "cuda":
        torch.cuda.synchronize()
    assert same_storage(got, want), (src_kind, dst_kind)
    heads = got.head_overlap(src)
    one = (heads[0], heads[0] + 1)
    copy_blocks(src, src_ids[:1], got, dst_ids[1:2], layers=[sizes["layers"] - 1], heads=one, backend="triton")
    copy_blocks(src, src_ids[:1], want, dst_ids[1:2], layers=[sizes["layers"] - 1], heads=one, backend="reference")
    if device == "cuda":
        torch.cuda.synchronize()
    assert same_storage(got, want)


@needs_interpreter
@pytest.mark.parametrize("src_kind", KINDS)
def test_interpreter_every_layout_pair(src_kind):
    for dst_kind in KINDS:
        check(src_kind, dst_kind)


@needs_interpreter
@pytest.mark.parametrize("src_tp,dst_tp", [((0, 1), (1, 2)), ((1, 2), (0, 1)), ((1, 2), (1, 2))])
def test_interpreter_tp_splits(src_tp, dst_tp):
    check("vllm", "flashinfer_hnd", sizes=dict(TINY, heads=4), src_tp=src_tp, dst_tp=dst_tp)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_interpreter_mla_and_dtypes(dtype):
    check("mla", "mla", dtype=dtype)
    check("vllm", "strided_dim", dtype=dtype)


def test_native_and_torch_backends_match_the_reference():
    for backend in ("native", "torch"):
        src, got, want = make("vllm", seed=1, **TINY), make("flashinfer_hnd", seed=2, **TINY), \
            make("flashinfer_hnd", seed=2, **TINY)
        copy_blocks(src, [4, 4, 0], got, [1, 2, 3], backend=backend)
        copy_blocks(src, [4, 4, 0], want, [1, 2, 3], backend="reference")
        assert same_storage(got, want)


@pytest.mark.parametrize("backend", ["native", "reference"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1"
                                                                else []))
def test_bad_arguments_raise_and_touch_nothing(backend):
    src, dst = make("vllm", seed=1, **TINY), make("vllm", seed=2, **TINY)
    before = [t.view(torch.uint8).clone() for t in dst.tensors]  # bytes: random bf16 holds NaNs
    with pytest.raises(ValueError):
        copy_blocks(src, [0, 1], dst, [2], backend=backend)  # counts differ
    with pytest.raises(ValueError):
        copy_blocks(src, [0, 1], dst, [2, 2], backend=backend)  # a destination twice
    with pytest.raises(ValueError):
        copy_blocks(src, [0], dst, [TINY["blocks"]], backend=backend)  # out of range
    with pytest.raises(ValueError):
        copy_blocks(src, [0], dst, [1], heads=(0, 3), backend=backend)  # heads outside the pools
    with pytest.raises(LayoutMismatch):
        copy_blocks(src, [0], make("vllm", seed=2, **dict(TINY, hd=8)), [1], backend=backend)
    with pytest.raises(LayoutMismatch):  # disjoint TP ranks share no head
        copy_blocks(make("vllm", tp_rank=0, tp_size=2, **dict(TINY, heads=1)), [0],
                    make("vllm", tp_rank=1, tp_size=2, **dict(TINY, heads=1)), [1], backend=backend)
    with pytest.raises(TypeError):
        copy_blocks(src, [0], "pool", [1], backend=backend)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, dst.tensors))


def test_compiles_for_sm90_with_16_byte_vectors():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from kvxfer.kernels import triton_copy

    kernel = triton_copy.copy_blocks_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # interpreter wraps it
    # Llama-3-8B bf16, per-layer NHD into HND: 16 tokens x 8 heads x 128 dims a tile
    constexprs = dict(SS0=1, SS1=16, SS2=8, SROW=32, DS0=1, DS1=8, DS2=16, DROW=32, TILE=4096, BLOCK=1024, VEC=2)
    signature = {name: "*i64" for name in ("src_ptr", "dst_ptr", "src_table_ptr", "dst_table_ptr", "src_ids_ptr",
                                            "dst_ids_ptr")}
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ops = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops, ops
    assert compiled.asm.get("cubin")


def test_word_and_vector_follow_both_sides():
    from kvxfer.kernels.tables import PoolTables
    from kvxfer.kernels.triton_copy import _word, consts

    wide = make("vllm", blocks=4, bs=16, heads=8, hd=128)
    odd = make("strided_dim", blocks=4, bs=16, heads=8, hd=128)
    a, b = PoolTables.of(wide).plane_table(wide.head_range), PoolTables.of(odd).plane_table(odd.head_range)
    assert _word(a, a) == (8, 2)
    word, vec = _word(a, b)
    assert word == 2 and vec == 1  # element-sized rows on one side: no vectors, 2-byte words
    c = consts(a, b, word, vec)
    assert c["SROW"] == c["TILE"] == 16 * 8 * 128 and c["DROW"] == 1  # a vLLM block tile is one row


@pytest.mark.gpu
@pytest.mark.parametrize("src_kind,dst_kind", [("vllm", "vllm"), ("vllm", "flashinfer_hnd"),
                                                ("cross_layer_blocks_outer", "vllm"), ("strided_dim", "padded_rows")])
def test_gpu_matches_reference(src_kind, dst_kind):
    check(src_kind, dst_kind, "cuda", dict(layers=3, blocks=64, bs=16, heads=8, hd=128), n=17)
