"""Parsing of the named-dims string and the engine tensors it describes.

The result is a list of *planes*: one per (layer, kv) pair, each a 4-d strided
view ``[N, B, H, D]`` of engine memory described by a base address and byte
strides. MLA caches (``C``) become planes with ``H = 1`` and ``D = C``.
"""
from __future__ import annotations

from dataclasses import dataclass

LETTERS = "L2NBHDC"
SUPPORTED_DTYPES = (
    "float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8",
)


@dataclass(frozen=True)
class Plane:
    """One (layer, kv) view of engine memory: ``[N, B, H, D]`` with byte strides."""

    tensor_index: int  # index into KVLayout.tensors
    offset: int  # bytes from that tensor's data_ptr to element [0, 0, 0, 0]
    strides: tuple  # (stride_n, stride_b, stride_h, stride_d) in bytes


def parse_dims(dims) -> tuple:
    """``"N 2 B H D"`` or ``"N2BHD"`` -> ``("N", "2", "B", "H", "D")``, validated."""
    if not isinstance(dims, str):
        raise TypeError(f"dims must be a string such as 'N 2 B H D', got {type(dims).__name__}")
    letters = tuple(dims.split()) if " " in dims.strip() else tuple(dims.strip())
    for letter in letters:
        if len(letter) != 1 or letter not in LETTERS:
            raise ValueError(f"dims {dims!r}: unknown dim {letter!r}; letters are {' '.join(LETTERS)}")
    if len(set(letters)) != len(letters):
        raise ValueError(f"dims {dims!r}: a letter is repeated")
    for need in "NB":
        if need not in letters:
            raise ValueError(f"dims {dims!r}: missing {need!r} ({'block' if need == 'N' else 'token in block'})")
    if "C" in letters:
        if "H" in letters or "D" in letters or "2" in letters:
            raise ValueError(f"dims {dims!r}: MLA latent 'C' excludes 'H', 'D' and '2'")
    elif "H" not in letters or "D" not in letters:
        raise ValueError(f"dims {dims!r}: need 'H' and 'D' (or 'C' for an MLA latent cache)")
    return letters


def strided_nbytes(sizes, byte_strides, itemsize: int) -> int:
    """Bytes from element 0 to the end of the last element of a strided array with
    non-negative strides: the span it covers, padding between elements included."""
    return sum((n - 1) * s for n, s in zip(sizes, byte_strides)) + itemsize


def tensor_span(tensor) -> tuple[int, int]:
    """``(addr, nbytes)`` of the memory a non-empty tensor's elements occupy (strides and
    views included; no negative strides)."""
    item = tensor.element_size()
    return tensor.data_ptr(), strided_nbytes(tensor.shape, [s * item for s in tensor.stride()], item)


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _as_list(x, what: str) -> list:
    if _is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)) and x and all(_is_tensor(t) for t in x):
        return list(x)
    raise TypeError(f"{what} must be a tensor or a non-empty list of tensors")


def collect(tensors, letters: tuple) -> tuple:
    """Group the caller's tensors as ``[[kv tensors] per layer-group]``.

    Returns ``(groups, split_kv)``: ``groups`` is a list of lists; with
    ``split_kv`` each group is ``[k, v]``, else ``[t]`` holding both (``2`` dim)
    or the MLA latent.
    """
    split_kv = "2" not in letters and "C" not in letters
    if not split_kv:
        items = _as_list(tensors, "tensors")
        if "L" in letters and len(items) != 1:
            raise ValueError("dims has 'L' (cross-layer) but a list of tensors was given; pass one tensor")
        return [[t] for t in items], False
    if isinstance(tensors, dict):
        try:
            tensors = (tensors["k"], tensors["v"])
        except KeyError as exc:
            raise TypeError("a dict of tensors needs keys 'k' and 'v'") from exc
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or _is_tensor(tensors):
        raise TypeError(
            "dims has no '2' dim, so tensors must be a (k, v) pair, each a tensor or a per-layer list"
        )
    k_list, v_list = _as_list(tensors[0], "k"), _as_list(tensors[1], "v")
    if len(k_list) != len(v_list):
        raise ValueError(f"k has {len(k_list)} layer tensors but v has {len(v_list)}")
    if "L" in letters and len(k_list) != 1:
        raise ValueError("dims has 'L' (cross-layer) but k/v are lists; pass one tensor each")
    return [[k, v] for k, v in zip(k_list, v_list)], True


def check_tensors(flat: list, letters: tuple, dims: str):
    """Rank, shape, dtype, device and stride checks shared by all tensors."""
    first = flat[0]
    for i, t in enumerate(flat):
        if t.dim() != len(letters):
            raise ValueError(
                f"dims {dims!r} names {len(letters)} dimensions but tensor {i} has {t.dim()} "
                f"(shape {tuple(t.shape)})"
            )
        if tuple(t.shape) != tuple(first.shape):
            raise ValueError(
                f"tensor {i} has shape {tuple(t.shape)} but tensor 0 has {tuple(first.shape)}; "
                "K and V (and all layers) must have the same shape"
            )
        if t.dtype != first.dtype:
            raise TypeError(f"tensor {i} has dtype {t.dtype} but tensor 0 has {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"tensor {i} is on {t.device} but tensor 0 is on {first.device}")
        for size, stride, letter in zip(t.shape, t.stride(), letters):
            if size > 1 and stride <= 0:
                raise ValueError(f"tensor {i}: dim {letter!r} has stride {stride}; aliased dims are not supported")
    if str(first.dtype).replace("torch.", "") not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {first.dtype} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
    shape = dict(zip(letters, first.shape))
    if "2" in shape and shape["2"] != 2:
        raise ValueError(f"the '2' (K/V) dim has size {shape['2']}, expected 2")
    for letter in "NBHDC":
        if shape.get(letter, 1) < 1:
            raise ValueError(f"dim {letter!r} has size 0")
    return shape


def make_planes(groups: list, split_kv: bool, letters: tuple, shape: dict) -> tuple:
    """Planes indexed ``[layer][kv]`` plus the tuple of distinct tensors."""
    tensors, index_of = [], {}

    def tensor_index(t) -> int:
        key = id(t)
        if key not in index_of:
            index_of[key] = len(tensors)
            tensors.append(t)
        return index_of[key]

    num_kv = 1 if "C" in letters else 2
    planes = []
    for group in groups:
        for li in range(shape.get("L", 1)):
            row = []
            for kv in range(num_kv):
                t = group[kv] if split_kv else group[0]
                itemsize = t.element_size()
                stride = {a: s * itemsize for a, s in zip(letters, t.stride())}
                offset = li * stride.get("L", 0) + (0 if split_kv else kv * stride.get("2", 0))
                last = "C" if "C" in letters else "D"
                strides = (stride["N"], stride["B"], stride.get("H", 0), stride[last])
                row.append(Plane(tensor_index(t), offset, strides))
            planes.append(tuple(row))  # one row per layer: L x len(groups) rows
    return tuple(planes), tuple(tensors)
