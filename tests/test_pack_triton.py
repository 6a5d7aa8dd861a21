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
    from kvxfer.runs import tile_copy

    layout = make("vllm", blocks=4, bs=16, heads=8, hd=128)
    job = tile_copy(layout, [3, 1])
    _, consts, grid = launch_args(layout, job, torch.empty(job.nbytes, dtype=torch.uint8))
    assert grid == (2, 2 * layout.num_layers)
    assert consts["TILE"] == 16 * 8 * 128 * 2 // 8 and consts["VEC"] == 2  # int64 words, 16-byte vectors
    odd = make("strided_dim", dtype=torch.float8_e4m3fn, **TINY)  # 1-byte rows
    _, consts, _ = launch_args(odd, tile_copy(odd, [0]), torch.empty(64, dtype=torch.uint8))
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


GPU_KINDS = ["vllm", "vllm_hnd_strides", "flashinfer_kv_pair", "cross_layer_blocks_outer", "strided_dim",
             "padded_rows", "mla", "sglang"]


def check_matches_reference(kind, device, sizes, num_ids):
    """Triton pack/unpack on ``device`` (default backend) equal the reference, byte for byte."""
    layout = make(kind, device=device, **sizes)
    assert layout.device.type == torch.device(device).type
    heads = None if layout.is_mla else (sizes["heads"] // 4, 3 * sizes["heads"] // 4)
    ids = torch.randperm(sizes["blocks"], generator=torch.Generator().manual_seed(1))[:num_ids]
    for h in (None, heads):
        want = kvxfer.pack(layout, ids, heads=h, backend="reference")
        assert torch.equal(kvxfer.pack(layout, ids, heads=h, backend="triton"), want)
    got, ref = make(kind, seed=3, device=device, **sizes), make(kind, seed=3, device=device, **sizes)
    wire = kvxfer.pack(layout, ids, backend="triton")
    kvxfer.unpack(got, wire, ids.flip(0), backend="triton")
    kvxfer.unpack(ref, wire, ids.flip(0), backend="reference")
    if layout.device.type == "cuda":
        torch.cuda.synchronize(layout.device)
    assert same_storage(got, ref)


@needs_interpreter
@pytest.mark.parametrize("kind", ["vllm", "sglang", "pool_views"])
def test_device_check_in_interpreter(kind):
    """The GPU test's own body, on CPU tensors: the case builders and checks work off-GPU too."""
    check_matches_reference(kind, "cpu", dict(layers=2, blocks=6, bs=2, heads=4, hd=4), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_matches_reference(kind):
    check_matches_reference(kind, "cuda", dict(layers=3, blocks=64, bs=16, heads=8, hd=128), 17)


@needs_interpreter
def test_tables_built_once_per_request(monkeypatch):
    """Per-layer calls of one request reuse the device ids and slices of one table: no
    new plane table and no new host->device tensor after the first call."""
    from kvxfer import runs
    from kvxfer.kernels.tables import PoolTables

    layout = make("vllm", layers=4, **{k: v for k, v in TINY.items() if k != "layers"})
    ids = [4, 0, 2]
    whole = kvxfer.pack(layout, ids, backend="reference")
    tables = PoolTables.of(layout)
    built = []
    real = runs.tile_copy
    monkeypatch.setattr("kvxfer.kernels.tables.tile_copy", lambda *a, **k: built.append(1) or real(*a, **k))
    made = []
    real_make = tables._make
    monkeypatch.setattr(tables, "_make", lambda host, stream: made.append(host.shape) or real_make(host, stream))
    step = layout.wire_nbytes(len(ids), layers=[0])
    for layer in range(4):
        part = kvxfer.pack(layout, ids, layers=[layer], backend="triton")
        assert torch.equal(part, whole[layer * step:(layer + 1) * step])
    assert len(built) == 1 and len(made) == 2  # one tile copy, one table, one ids tensor
    full = tables.table_entry(layout.head_range, 8, (0, 1, 2, 3), None)[1]
    assert tables.table_entry(layout.head_range, 8, (2, 3), None)[1].data_ptr() == full[4:].data_ptr()  # a view
    assert torch.equal(kvxfer.pack(layout, ids, layers=[3, 1], backend="triton"),
                       kvxfer.pack(layout, ids, layers=[3, 1], backend="reference"))  # gathered table
    assert torch.equal(kvxfer.pack(layout, ids[::-1], backend="triton"),
                       kvxfer.pack(layout, ids[::-1], backend="reference"))  # ids keyed by contents


def test_device_guard_names_the_pool_device():
    from kvxfer.kernels.common import device_guard

    guard = device_guard(torch.device("cuda", 3))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 3
    with device_guard(torch.device("cpu")):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_launch_follows_pool_device_not_current():
    """A thread whose current device is 0 packs a pool on device 1 correctly."""
    import threading

    layout = make("vllm", device="cuda:1", layers=2, blocks=16, bs=16, heads=8, hd=128)
    out = {}

    def worker():
        torch.cuda.set_device(0)
        out["wire"] = kvxfer.pack(layout, [5, 1, 9])
        torch.cuda.synchronize(1)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert out["wire"].device == torch.device("cuda", 1)
    assert torch.equal(out["wire"], kvxfer.pack(layout, [5, 1, 9], backend="reference"))


def check_repeated_calls(device):
    """Repeated calls reuse one cached plan and stay bitwise: every layer of a request, into
    outputs of both vector alignments, packs and unpacks, and wrong arguments that compare
    equal to cached ones (``1.0``, ``True``, duplicates for unpack) still fail."""
    from kvxfer.kernels.tables import PoolTables

    layout = make("vllm", device=device, layers=4, blocks=8, bs=2, heads=2, hd=16)
    ids = [5, 0, 3]
    whole = kvxfer.pack(layout, ids, backend="reference")
    step = layout.wire_nbytes(len(ids), layers=[0])
    raw = torch.zeros(2 * whole.numel() + 64, dtype=torch.uint8, device=device)
    for rounds in range(2):
        for offset in (0, 8, 16):  # 16-byte aligned, 8-byte aligned, aligned again
            out = raw[offset:offset + whole.numel()]
            out.zero_()
            for layer in range(4):
                kvxfer.pack(layout, ids, layers=[layer], out=out[layer * step:(layer + 1) * step],
                            backend="triton")
            assert torch.equal(out, whole), (rounds, offset)
            assert torch.equal(kvxfer.pack(layout, ids, out=out, backend="triton"), whole)
    got, ref = make("vllm", seed=2, device=device, layers=4, blocks=8, bs=2, heads=2, hd=16), \
        make("vllm", seed=2, device=device, layers=4, blocks=8, bs=2, heads=2, hd=16)
    for _ in range(2):
        kvxfer.unpack(got, whole, [1, 7, 2], backend="triton")
    kvxfer.unpack(ref, whole, [1, 7, 2], backend="reference")
    assert same_storage(got, ref)
    plans = len(PoolTables.of(layout)._plans)
    assert plans == 4 + 1  # one per layer, the whole request; calls with other offsets reuse them
    with pytest.raises(TypeError):
        kvxfer.pack(layout, [5, 0, 3.0], backend="triton")
    with pytest.raises(TypeError):
        kvxfer.pack(layout, [5, 0, 3], layers=[True], backend="triton")
    kvxfer.pack(layout, [1, 1], backend="triton")  # repeats are fine for pack ...
    with pytest.raises(ValueError, match="duplicates"):
        kvxfer.unpack(got, whole, [1, 1, 2], backend="triton")  # ... never for unpack
    with pytest.raises(ValueError, match="out of range"):
        kvxfer.pack(layout, [5, 0, 8], backend="triton")
    with pytest.raises(ValueError, match="needs"):
        kvxfer.pack(layout, ids, out=raw[:step], backend="triton")


@needs_interpreter
def test_repeated_calls_reuse_a_plan_in_interpreter(monkeypatch):
    from kvxfer.kernels import common

    calls = []
    real = common.resolve
    monkeypatch.setattr(common, "resolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    check_repeated_calls("cpu")
    # validated once per distinct call: 4 layers, the whole request, the unpack, and the
    # failing calls (never cached); array ids key by dtype and bytes
    layout = make("vllm", layers=2, blocks=8, bs=2, heads=2, hd=16)
    import numpy as np

    before = len(calls)
    for _ in range(3):
        kvxfer.pack(layout, np.array([3, 1]), backend="triton")
        kvxfer.pack(layout, np.array([3, 1], dtype=np.int32), backend="triton")
        kvxfer.pack(layout, torch.tensor([3, 1]), backend="triton")  # a host tensor keys as its array
    assert len(calls) - before == 2
    with pytest.raises(TypeError):
        kvxfer.pack(layout, torch.tensor([3.0, 1.0], dtype=torch.bfloat16), backend="triton")


@pytest.mark.gpu
def test_gpu_repeated_calls_launch_the_compiled_kernel():
    """On CUDA the second call launches the cached compiled kernel (no Triton binding)."""
    from kvxfer.kernels.tables import PoolTables

    check_repeated_calls("cuda")
    layout = make("vllm", device="cuda", layers=2, blocks=8, bs=2, heads=2, hd=16)
    kvxfer.pack(layout, [2, 4])
    plan = next(iter(PoolTables.of(layout)._plans.values()))
    assert any(launch.runner for launch in plan.by_word.values())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # tables built on the default stream, used on another
        wire = kvxfer.pack(layout, [2, 4])
    side.synchronize()
    assert torch.equal(wire, kvxfer.pack(layout, [2, 4], backend="reference"))
