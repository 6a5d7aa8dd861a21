"""Triton pack/unpack: interpreter runs on tiny CPU shapes, an sm_90 compile, GPU checks."""
import os
import re

import pytest
import torch

import kvxfer
from pack_cases import make, same_storage

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU tensors run the Triton kernel only in the interpreter")
TINY = dict(layers=2, blocks=5, bs=2, heads=2, hd=4)


@needs_interpreter
@pytest.mark.parametrize("kind", ["vllm", "vllm_hnd_strides", "flashinfer_kv_pair", "cross_layer_blocks_outer",
                                  "strided_dim", "padded_rows", "mla"])
def test_interpreter_pack_unpack_match_reference(kind):
    layout = make(kind, **TINY)
    heads = None if layout.is_mla else (1, 2)
    for ids, layers, h in (([4, 0, 2], None, None), ([3], [1], heads), ([], None, None)):
        want = kvxfer.pack(layout, ids, layers=layers, heads=h, backend="reference")
        assert torch.equal(kvxfer.pack(layout, ids, layers=layers, heads=h, backend="triton"), want)
    got, ref = make(kind, seed=4, **TINY), make(kind, seed=4, **TINY)
    wire = kvxfer.pack(layout, [1, 3], heads=heads, backend="reference")
    kvxfer.unpack(got, wire, [2, 0], heads=heads, backend="triton")
    kvxfer.unpack(ref, wire, [2, 0], heads=heads, backend="reference")
    assert same_storage(got, ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_interpreter_dtypes(dtype):
    layout = make("flashinfer_hnd", dtype=dtype, **TINY)
    assert torch.equal(kvxfer.pack(layout, [4, 1], backend="triton"),
                       kvxfer.pack(layout, [4, 1], backend="reference"))


def test_word_and_vector_choice():
    from kvxfer.kernels.triton_pack import launch_args
    from kvxfer.runs import make_plan

    layout = make("vllm", blocks=4, bs=16, heads=8, hd=128)
    plan = make_plan(layout, [3, 1])
    _, consts, grid = launch_args(layout, plan, torch.empty(plan.nbytes, dtype=torch.uint8))
    assert grid == (2, 2 * layout.num_layers)
    assert consts["TILE"] == 16 * 8 * 128 * 2 // 8 and consts["VEC"] == 2  # int64 words, 16-byte vectors
    odd = make("strided_dim", dtype=torch.float8_e4m3fn, **TINY)  # 1-byte rows
    _, consts, _ = launch_args(odd, make_plan(odd, [0]), torch.empty(64, dtype=torch.uint8))
    assert consts["ROW"] == 1 and consts["VEC"] == 1


def test_compiles_for_sm90_with_16_byte_vectors():
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from kvxfer.kernels import triton_pack

    kernel = triton_pack.copy_tiles_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # interpreter wraps it
    constexprs = dict(S0=1, S1=16, S2=8, ROW=32, TILE=4096, BLOCK=1024, VEC=2, TO_WIRE=True)
    signature = {"pool_ptr": "*i64", "wire_ptr": "*i64", "table_ptr": "*i64", "ids_ptr": "*i64", "num_ids": "i32",
                 **{name: "constexpr" for name in constexprs}}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ops = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops, ops
    assert compiled.asm.get("cubin")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["vllm", "vllm_hnd_strides", "flashinfer_kv_pair", "cross_layer_blocks_outer",
                                  "strided_dim", "padded_rows", "mla", "sglang"])
def test_gpu_matches_reference(kind):
    layout = _cuda_layout(kind)
    heads = None if layout.is_mla else (2, 6)
    ids = torch.randperm(64)[:17]
    for h in (None, heads):
        want = kvxfer.pack(layout, ids, heads=h, backend="reference")
        assert torch.equal(kvxfer.pack(layout, ids, heads=h), want)
    got, ref = _cuda_layout(kind, seed=3), _cuda_layout(kind, seed=3)
    wire = kvxfer.pack(layout, ids)
    kvxfer.unpack(got, wire, ids.flip(0))
    kvxfer.unpack(ref, wire, ids.flip(0), backend="reference")
    torch.cuda.synchronize()
    assert same_storage(got, ref)


def _cuda_layout(kind, seed=0):
    """The same kind of layout with its storages moved to the GPU."""
    host = make(kind, seed=seed, blocks=64, bs=16, heads=8, hd=128)
    moved = {}
    tensors = []
    for t in host.tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in moved:
            moved[s.data_ptr()] = s.cuda()
        tensors.append(torch.empty(0, dtype=t.dtype, device="cuda").set_(moved[s.data_ptr()], t.storage_offset(),
                                                                        t.shape, t.stride()))
    remap = dict(zip([id(t) for t in host.tensors], tensors))
    planes = host.planes  # tensor indices and byte offsets are storage-relative, so they carry over
    return type(host)(dims=host.dims, tensors=tuple(remap[id(t)] for t in host.tensors), planes=planes,
                      num_layers=host.num_layers, num_kv=host.num_kv, num_blocks=host.num_blocks,
                      block_size=host.block_size, num_heads=host.num_heads, head_dim=host.head_dim)
