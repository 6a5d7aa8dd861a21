"""Bad input raises ValueError/TypeError naming the problem, before memory is touched."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer.layout import KVLayout
from pack_cases import N, make, storage_bytes


@pytest.fixture
def layout():
    return make("vllm")


@pytest.mark.parametrize("ids,exc,match", [
    ([N], ValueError, "out of range"), ([0, -1], ValueError, "negative"), ([2**70], ValueError, "out of range"),
    ([1.0], TypeError, "ints"), ([True], TypeError, "ints"), (torch.tensor([1.0]), TypeError, "integer dtype"),
    (np.array([0.5]), TypeError, "integer dtype"), (np.array([[1]]), ValueError, "1-d"), ("12", TypeError, "block_ids"),
    (torch.tensor([0, 1], dtype=torch.bool), TypeError, "integer dtype"),
])
def test_bad_block_ids(layout, ids, exc, match):
    with pytest.raises(exc, match=match):
        kvxfer.pack(layout, ids)


def test_bad_layers_and_heads(layout):
    for kwargs, exc, match in [({"layers": [5]}, ValueError, "out of range"), ({"layers": [0, 0]}, ValueError, "dup"),
                               ({"layers": []}, ValueError, "empty"), ({"layers": ["a"]}, TypeError, "layers"),
                               ({"heads": (0, 5)}, ValueError, "inside"), ({"heads": (2, 2)}, ValueError, "inside"),
                               ({"heads": 3}, TypeError, "range"), ({"heads": (0.0, 1)}, TypeError, "ints")]:
        with pytest.raises(exc, match=match):
            kvxfer.pack(layout, [1], **kwargs)


def test_tp_rank_head_range_enforced():
    rank1 = make("vllm", heads=2, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"\(2, 4\)"):
        kvxfer.pack(rank1, [0], heads=(0, 2))
    assert kvxfer.pack(rank1, [0], heads=(2, 3)).numel() == rank1.wire_nbytes(1, heads=(2, 3))


def test_bad_out_and_buf(layout):
    need = layout.wire_nbytes(2)
    for out, exc, match in [(torch.empty(need - 1, dtype=torch.uint8), ValueError, "needs"),
                            (torch.empty(need, dtype=torch.int8), TypeError, "uint8"),
                            (torch.empty(need, dtype=torch.uint8, device="meta"), ValueError, "meta"),
                            (torch.empty(2 * need, dtype=torch.uint8)[::2], ValueError, "contiguous"),
                            (np.zeros(need, dtype=np.uint8), TypeError, "torch.Tensor")]:
        with pytest.raises(exc, match=match):
            kvxfer.pack(layout, [1, 2], out=out)
    before = storage_bytes(layout)
    with pytest.raises(ValueError, match="duplicates"):
        kvxfer.unpack(layout, torch.zeros(need, dtype=torch.uint8), [3, 3])
    with pytest.raises(ValueError, match="needs"):
        kvxfer.unpack(layout, torch.zeros(need - 2, dtype=torch.uint8), [3, 4])
    assert all(torch.equal(a, b) for a, b in zip(before, storage_bytes(layout)))


def test_bad_layout_and_backend(layout):
    with pytest.raises(TypeError, match="KVLayout"):
        kvxfer.pack("layout", [0])
    with pytest.raises(ValueError, match="backend"):
        kvxfer.pack(layout, [0], backend="cuda")


def test_mixed_devices_rejected():
    k = torch.zeros(N, 2, 4, 8)
    with pytest.raises(ValueError, match="meta"):
        KVLayout.from_tensors((k, torch.zeros(N, 2, 4, 8, device="meta")), "N B H D")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=st.permutations(["N", "B", "H", "D", "2"]),
    sizes=st.tuples(*[st.integers(1, 4)] * 4),
    ids=st.lists(st.integers(-3, 8), max_size=6),
    layers=st.one_of(st.none(), st.lists(st.integers(-1, 3), max_size=3)),
    heads=st.one_of(st.none(), st.tuples(st.integers(-1, 5), st.integers(-1, 5))),
    dtype=st.sampled_from([torch.float16, torch.float8_e4m3fn, torch.float32]),
    backend=st.sampled_from(["native", "torch"]),
)
def test_random_shapes_and_ids_never_crash(dims, sizes, ids, layers, heads, dtype, backend):
    n, b, h, d = sizes
    size = {"N": n, "B": b, "H": h, "D": d, "2": 2}
    per_layer = [torch.randn([size[x] for x in dims]).to(dtype) for _ in range(2)]
    layout = KVLayout.from_tensors(per_layer, " ".join(dims))
    try:
        wire = kvxfer.pack(layout, ids, layers=layers, heads=heads, backend=backend)
    except (ValueError, TypeError):
        return
    assert torch.equal(wire, kvxfer.pack(layout, ids, layers=layers, heads=heads, backend="reference"))
    try:
        kvxfer.unpack(layout, wire, ids, layers=layers, heads=heads, backend=backend)
    except ValueError as exc:
        assert "duplicates" in str(exc)
