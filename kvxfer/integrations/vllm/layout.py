"""vLLM's CPU KV pool as a :class:`~kvxfer.KVLayout`.

vLLM CPU hands ``register_kv_caches`` one tensor per layer,
``[num_blocks, kv_heads, block_size, 2 * head_dim]``, views into one storage.
Per (block, head) the ``block_size * 2 * head_dim`` elements are K then V; V is
``[B, D]`` but K may be stored transposed (``[D, B]``) depending on the CPU
attention kernel path (``vec``, ``vec16``, ``amx``, ``neon``, ...), which vLLM
picks from dtype, block size, head size and the CPU. kvxfer does not name K's
inner order: each layer is viewed as ``[N, H, 2, B*D]`` bytes
(dims ``"N H 2 B D"``, exact for V, byte-equal for K), and the kernel path goes
into the layout fingerprint (``byte_format="vllm-cpu:<path>"``), so two engines
exchange blocks only when they lay them out identically -- ``connect`` raises
``LayoutMismatch`` otherwise. Whole blocks and whole heads are moved, never
token slices, so the bytes land exactly where the same kernel reads them. Under
tensor parallelism each rank's ``H`` is its own slice of the model's kv heads; a head
is one contiguous ``[2, B*D]`` run of a block, so any head range is a run per block
and pairs of different TP degrees move zero-copy (or packed where the cost model
prefers).
"""
from __future__ import annotations


def attention_path(vllm_config, block_size: int, head_dim: int) -> str:
    """The CPU attention kernel path vLLM uses for this model (e.g. ``vec``, ``amx``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(vllm_config.model_config.dtype, block_size, head_dim,
                         vllm_config.cache_config.cache_dtype)


def cpu_layout(kv_caches: dict, vllm_config, *, tp_rank: int = 0, tp_size: int = 1):
    """``{layer_name: [N, H, B, 2*D] tensor}`` (in layer order; ``H``: this rank's kv
    heads, rank ``tp_rank`` of ``tp_size``) -> KVLayout with the path."""
    from ... import KVLayout

    tensors = list(kv_caches.values())
    if not tensors or any(t.dim() != 4 for t in tensors):
        raise ValueError("expected vLLM CPU KV caches [num_blocks, kv_heads, block_size, 2*head_dim]")
    if tensors[0].device.type != "cpu":
        raise ValueError(f"KVXferConnector supports vLLM's CPU pool; got {tensors[0].device}")
    num_blocks, heads, block, two_d = tensors[0].shape
    if two_d % 2:
        raise ValueError(f"last dim {two_d} is not 2 * head_dim")
    if any(t.stride(3) != 1 or t.stride(2) != two_d for t in tensors):
        raise ValueError("each (block, head) of the CPU pool must be one contiguous [B, 2*D] chunk")
    path = attention_path(vllm_config, block, two_d // 2)
    views = [t.view(num_blocks, heads, 2, block, two_d // 2) for t in tensors]
    return KVLayout.from_tensors(views, "N H 2 B D", tp_rank=tp_rank, tp_size=tp_size,
                                 byte_format=f"vllm-cpu:{path}")
