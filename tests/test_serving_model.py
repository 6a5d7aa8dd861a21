"""The real model (SmolLM2-135M GGUF): tokenizer, paged attention vs dense, determinism.

The model is loaded once per session; prompts are short and max_tokens small.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from kvxfer.serving.model.attention import Chunk  # noqa: E402
from kvxfer.serving.engine.config import EngineConfig  # noqa: E402
from kvxfer.serving.model.kv_cache import KVCache  # noqa: E402
from kvxfer.serving.engine.sampling import SamplingParams  # noqa: E402
from kvxfer.serving.model.tokenizer import render_chatml  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press")


@pytest.fixture(scope="session")
def engine():
    try:
        from kvxfer.serving.model.gguf_loader import default_model_path

        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    from kvxfer.serving.engine.engine import Engine

    threads = torch.get_num_threads()  # one thread: the test machine's cores are shared
    yield Engine(EngineConfig(num_blocks=96, max_num_batched_tokens=256, num_threads=1))
    torch.set_num_threads(threads)


def _private_pool(engine):
    cfg = engine.model_config
    return KVCache(24, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)


@pytest.fixture()
def spare(engine):
    """The same weights (and matmul dtype) over a private pool, so tests never touch the
    engine's cached blocks."""
    return engine.model.with_cache(_private_pool(engine))


def _bf16_or_skip():
    from kvxfer.serving.model.linear import bf16_supported

    if not bf16_supported():
        pytest.skip("no bf16 oneDNN kernels on this CPU")


@pytest.fixture(params=["fp32", "bf16"])
def spare_any(engine, request):
    """:func:`spare` in each matmul dtype (bf16 where this CPU has the kernels)."""
    if request.param == "bf16":
        _bf16_or_skip()
    return engine.model.with_cache(_private_pool(engine)).with_matmul(request.param)


def greedy_tokens(model, ids, table, n):
    """Prefill ``ids`` into ``table``, then greedy-decode ``n`` tokens one at a time."""
    logits = model.forward([Chunk(ids, 0, table)])
    out = [int(logits[0].argmax())]
    while len(out) < n:
        logits = model.forward([Chunk([out[-1]], len(ids) + len(out) - 1, table)])
        out.append(int(logits[0].argmax()))
    return out


def dense_reference(model, ids):
    """Non-paged forward of ``ids``: logits ``[T, vocab]`` (complex rotary, SDPA)."""
    import torch.nn.functional as F

    from kvxfer.serving.model.model import rms_norm

    cfg = model.config
    t = len(ids)
    pos = torch.arange(t, dtype=torch.float64)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    rot = torch.polar(torch.ones(t, cfg.head_dim // 2, dtype=torch.float64), torch.outer(pos, inv))

    def rope(x):  # adjacent pairs as complex numbers
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * rot[:, None, :]).flatten(-2).float()

    x = model.embed[torch.tensor(ids)]
    group = cfg.num_heads // cfg.num_kv_heads
    for w in model.layers:
        q, k, v = (rms_norm(x, w.attn_norm, cfg.rms_eps) @ w.qkv.T).split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size], -1)
        q = rope(q.view(t, cfg.num_heads, cfg.head_dim)).transpose(0, 1)
        k = rope(k.view(t, cfg.num_kv_heads, cfg.head_dim)).repeat_interleave(group, 1).transpose(0, 1)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, 1).transpose(0, 1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.transpose(0, 1).reshape(t, -1) @ w.o.T
        gate, up = (rms_norm(x, w.ffn_norm, cfg.rms_eps) @ w.gate_up.T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w.down.T
    return rms_norm(x, model.final_norm, cfg.rms_eps) @ model.lm_head.T


def test_config_from_metadata(engine):
    cfg = engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.tied_embeddings) == (576, 49152, True)


def test_tokenizer_round_trip_and_chat_template(engine):
    tok = engine.tokenizer
    for text in ["Hello world!", "  two  spaces\nnew line", "digits 12345", "héllo 日本語 🙂"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user") [0] == 1
    assert tok.decode(tok.encode("<|im_end|>"), skip_special_tokens=False) == "<|im_end|>"
    assert tok.render_chat(FRANCE) == render_chatml(FRANCE)  # jinja2 template == fallback
    ids = tok.apply_chat_template(FRANCE)
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        tok.decode([49152])


def test_greedy_chat_is_sensible_and_stable(engine):
    params = SamplingParams(temperature=0, max_tokens=10)
    first = list(engine.stream(messages=FRANCE, params=params))
    second = list(engine.stream(messages=FRANCE, params=params))
    assert [e.token_id for e in first] == [e.token_id for e in second]
    assert "Paris" in "".join(e.text for e in first)
    assert first[-1].finished and not any(e.finished for e in first[:-1])


def test_paged_equals_dense_reference(engine):
    spare = engine.model.with_cache(_private_pool(engine)).with_matmul("fp32")
    ids = engine.tokenizer.encode(LONG)  # > one block
    dense = dense_reference(engine.model, ids)
    paged = torch.cat([spare.forward([Chunk([tok], i, (3, 7, 1))]) for i, tok in enumerate(ids)])
    assert torch.allclose(paged, dense, atol=2e-4, rtol=1e-4), (paged - dense).abs().max()
    assert torch.equal(paged.argmax(-1), dense.argmax(-1))
    prefill = spare.forward([Chunk(ids, 0, (5, 2, 9))])
    assert torch.allclose(prefill[0], dense[-1], atol=2e-4, rtol=1e-4)


def test_bf16_matmuls_stay_close_to_the_fp32_reference(engine):
    _bf16_or_skip()
    spare = engine.model.with_cache(_private_pool(engine)).with_matmul("bf16")
    ids = engine.tokenizer.encode(LONG)
    dense = dense_reference(engine.model, ids)
    paged = torch.cat([spare.forward([Chunk(ids[:i + 1], 0, (3, 7, 1))]) for i in
                       range(len(ids) - 4, len(ids))])
    top = dense[-4:].argmax(-1)
    assert torch.equal(paged.argmax(-1), top)
    assert (paged - dense[-4:]).abs().max() < 0.05 * dense[-4:].abs().max()
    assert spare.kv_cache.kv_layout().byte_format == "matmul-bf16"


def test_kv_moved_to_other_blocks_decodes_identically(engine, spare_any):
    spare = spare_any
    cfg = engine.model_config
    ids = engine.tokenizer.encode(LONG)
    n = 6
    want = greedy_tokens(spare, ids, (0, 1, 2), n)
    # "process A" prefills into its pool; "process B" gets the blocks at other ids
    pool_a = spare
    pool_b = spare.with_cache(KVCache(40, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim))
    logits = pool_a.forward([Chunk(ids, 0, (4, 5, 6))])
    first = int(logits[0].argmax())
    pool_b.kv_cache.tensor[[31, 2, 17]] = pool_a.kv_cache.tensor[[4, 5, 6]]
    assert torch.equal(pool_b.kv_cache.tensor[[31, 2, 17]], pool_a.kv_cache.tensor[[4, 5, 6]])
    # the prompt's full blocks have the same bits whichever block ids held them
    assert torch.equal(pool_a.kv_cache.tensor[[4]], pool_a.kv_cache.tensor[[0]])
    out = [first]
    while len(out) < n:
        logits = pool_b.forward([Chunk([out[-1]], len(ids) + len(out) - 1, (31, 2, 17))])
        out.append(int(logits[0].argmax()))
    assert out == want


def test_batch_decode_equals_single_decode_bitwise(engine, spare_any):
    spare = spare_any
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", LONG, "1, 2, 3,")]
    tables = [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    firsts = [int(spare.forward([Chunk(p, 0, t)])[0].argmax()) for p, t in zip(prompts, tables)]
    chunks = [Chunk([f], len(p), t) for f, p, t in zip(firsts, prompts, tables)]
    batched = spare.forward(chunks)
    singles = torch.cat([spare.forward([c]) for c in chunks])
    assert torch.equal(batched, singles)
    reordered = spare.forward(chunks[::-1])
    assert torch.equal(reordered.flip(0), singles)


def test_decode_of_mixed_context_lengths_equals_single_decode_bitwise(engine, spare_any):
    """Short and long contexts in one decode step attend in separate width groups (a short
    one is never padded to the long one's length); each gets the bits it gets alone."""
    from kvxfer.serving.model.attention import StepBatch, _width_groups

    assert _width_groups([1, 8, 2, 1, 3, 16, 5]) == [[0, 3], [2], [4], [1, 6], [5]]
    assert _width_groups([]) == []
    spare = spare_any
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", " ".join([LONG] * 3), "1, 2, 3, 4, 5, 6, 7, 8,")]
    tables = [(0,), tuple(range(10, 20)), (1, 2)]
    assert all(len(p) < 16 * len(t) for p, t in zip(prompts, tables))
    firsts = [int(spare.forward([Chunk(p, 0, t)])[0].argmax()) for p, t in zip(prompts, tables)]
    chunks = [Chunk([f], len(p), t) for f, p, t in zip(firsts, prompts, tables)]
    step = StepBatch(chunks, block_size=16, num_blocks=24, max_position=2048)
    assert len(step.single_groups) == 3  # widths 1, 8+ and 2 blocks
    batched = spare.forward(chunks)
    singles = torch.cat([spare.forward([c]) for c in chunks])
    assert torch.equal(batched, singles)
    assert torch.equal(spare.forward(chunks[::-1]).flip(0), singles)


def test_mixed_step_equals_separate_steps_bitwise(engine, spare_any):
    """A step holding decode tokens of several sequences and a prompt chunk gives each
    sequence the same logits and KV bits as running it alone (every matmul call has
    ROW_TILE rows, kvxfer.serving.model.linear)."""
    spare = spare_any
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", LONG, "1, 2, 3, 4, 5, 6, 7,")]
    tables = [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    firsts = [int(spare.forward([Chunk(p, 0, t)])[0].argmax()) for p, t in zip(prompts, tables)]
    decodes = [Chunk([f], len(p), t) for f, p, t in zip(firsts, prompts, tables)]
    prompt = tok.encode(LONG + " in Mainz")
    alone = [spare.forward([c]) for c in decodes]
    kv_alone = spare.kv_cache.tensor[[0, 1, 3, 4, 5, 6]].clone()
    spare.forward([Chunk(prompt[:5], 0, (9, 10, 11))])
    want_prefill = spare.forward([Chunk(prompt[5:], 5, (9, 10, 11))])
    kv_prefill = spare.kv_cache.tensor[[9, 10, 11]].clone()
    spare.kv_cache.tensor[[9, 10, 11]] = 0
    spare.forward([Chunk(prompt[:5], 0, (9, 10, 11))])
    mixed = spare.forward([decodes[2], Chunk(prompt[5:], 5, (9, 10, 11)), decodes[0], decodes[1]])
    assert torch.equal(mixed[[2, 3, 0]], torch.cat(alone))
    assert torch.equal(mixed[1], want_prefill[0])
    assert torch.equal(spare.kv_cache.tensor[[0, 1, 3, 4, 5, 6]], kv_alone)
    assert torch.equal(spare.kv_cache.tensor[[9, 10, 11]], kv_prefill)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "plain"])
def test_tiled_linear_rows_do_not_depend_on_count_or_position(dtype):
    """The property batch invariance relies on: a row's bits through the model's linears
    do not depend on how many rows share the call, where the row sits, or 1 vs 2 threads
    (in the ROW_TILE calls of one-token chunks and the PROMPT_TILE calls of prompt rows)."""
    if dtype == "bf16":
        _bf16_or_skip()
    from kvxfer.serving.model.linear import ROW_TILE, TiledLinear, make_linear

    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * ROW_TILE + 5, 576, generator=gen)
    try:
        for w in (torch.randn(960, 576, generator=gen), torch.randn(3072, 576, generator=gen),
                  torch.randn(576, 1536, generator=gen)[:, :576]):
            # plain: the pure F.linear tiles, used where torch has no oneDNN
            w = w.contiguous()
            lin = TiledLinear(w) if dtype == "plain" else make_linear(w, dtype)
            for n in (1, 2):
                torch.set_num_threads(n)
                alone = torch.cat([lin(x[r:r + 1]) for r in range(len(x))])
                assert torch.equal(lin(x), alone), n
                for rows in (2, 4, 7, 12, 16, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 3):
                    assert torch.equal(lin(x[:rows]), alone[:rows]), (n, rows)
                perm = torch.randperm(len(x), generator=gen)
                assert torch.equal(lin(x[perm]), alone[perm]), n
                # prompt-chunk rows (after the first small_rows) run in PROMPT_TILE calls
                prompt = torch.cat([lin(x[r:r + 1], 0) for r in range(len(x))])
                assert torch.equal(lin(x, 0), prompt), n
                for small in (1, 3, ROW_TILE + 2):
                    mixed = lin(torch.cat([x[:small], x[perm]]), small)
                    assert torch.equal(mixed, torch.cat([alone[:small], prompt[perm]])), (n, small)
            ref = torch.nn.functional.linear(x, w)  # bf16: bf16 inputs/output, fp32 sums
            assert (alone - ref).abs().max() < (0.02 if dtype == "bf16" else 1e-5) * ref.abs().max()
    finally:
        torch.set_num_threads(threads)


def test_matmul_dtype_choice_and_errors():
    from kvxfer.serving.model.linear import (amx_available, bf16_supported,
                                             resolve_matmul_dtype)

    assert resolve_matmul_dtype("fp32") == "fp32"
    want = "bf16" if bf16_supported() and amx_available() else "fp32"
    assert resolve_matmul_dtype("auto") == want
    with pytest.raises(ValueError):
        resolve_matmul_dtype("fp16")
    with pytest.raises(ValueError):
        EngineConfig(matmul_dtype="int8")


def test_prefix_reuse_gives_same_output(engine, spare):
    tok = engine.tokenizer
    shared = LONG + " that could print pages quickly for many readers"
    params = SamplingParams(temperature=0, max_tokens=5)
    engine.generate([shared + " books"], params)  # caches the shared full blocks
    seq = engine.make_sequence(shared + " newspapers", params)
    hits, _ = engine.block_manager.match_prefix(seq.token_ids)
    assert len(hits) >= 2
    got = engine.generate([shared + " newspapers"], params)[0]
    assert got == greedy_tokens(spare, tok.encode(shared + " newspapers"), (0, 1, 2, 3), 5)


def test_chunked_prefill_matches_whole(engine, spare):
    from kvxfer.serving.engine.scheduler import Scheduler

    ids = engine.tokenizer.encode(LONG + " and paper")
    saved = engine.runtime.scheduler
    engine.runtime.scheduler = Scheduler(EngineConfig(num_blocks=96, max_num_batched_tokens=10,
                                              enable_prefix_caching=False), engine.block_manager)
    engine.block_manager.enable_prefix_caching = False
    try:
        got = engine.generate([ids], SamplingParams(temperature=0, max_tokens=4))[0]
    finally:
        engine.runtime.scheduler = saved
        engine.block_manager.enable_prefix_caching = True
    assert got == greedy_tokens(spare, ids, (0, 1, 2), 4)


def test_sampling_seed_stop_and_length(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=123)
    a = engine.generate(["Once upon a time"], params)[0]
    b = engine.generate(["Once upon a time"], params)[0]
    assert a == b and len(a) == 8
    events = list(engine.stream(messages=FRANCE, params=SamplingParams(
        temperature=0, max_tokens=10, stop=(" Paris",))))
    assert events[-1].finish_reason == "stop"
    text = "".join(e.text for e in events)
    assert "Paris" not in text and text.startswith("The capital of France is")
    events = list(engine.stream("Hello", SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True)))
    assert len(events) == 3 and events[-1].finish_reason == "length"


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError):
        engine.add_request("x", SamplingParams(max_tokens=96 * 16))
    with pytest.raises(ValueError):
        engine.add_request([engine.model_config.vocab_size])
    with pytest.raises(ValueError):
        engine.add_request()
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        engine.model.forward([Chunk([1, 2], 0, (96,))])
    with pytest.raises(ValueError):
        engine.model.forward([Chunk([1] * 20, 0, (0,))])  # table too short


def test_kv_layout_describes_the_pool(engine):
    pytest.importorskip("kvxfer.layout")
    layout = engine.kv_layout()
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (30, 96, 16)
    assert (layout.num_heads, layout.head_dim) == (3, 64)
    assert engine.kv_layout() is layout
    assert engine.kv_cache.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4


def test_pools_of_different_matmul_dtypes_do_not_exchange_blocks(engine):
    """A prefill/decode pair whose matmul dtypes differ fails the KV handshake (their
    layout fingerprints differ) instead of decoding from KV the other dtype made."""
    _bf16_or_skip()
    pytest.importorskip("kvxfer.layout")
    from kvxfer.errors import LayoutMismatch

    fp32 = engine.model.with_cache(_private_pool(engine)).with_matmul("fp32")
    bf16 = engine.model.with_cache(_private_pool(engine)).with_matmul("bf16")
    assert fp32.kv_cache.kv_layout().compatible_with(fp32.kv_cache.kv_layout())
    with pytest.raises(LayoutMismatch, match="format"):
        bf16.kv_cache.kv_layout().check_compatible(fp32.kv_cache.kv_layout())


def test_logprobs_are_the_models_log_softmax(engine, spare):
    """Each token's reported logprob and top alternatives are ``log_softmax`` of the
    model's logits at that position (not the temperature-scaled sampler's)."""
    from kvxfer.serving.engine.sampling import token_logprobs

    ids = engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=4, logprobs=3)
    events = list(engine.stream(ids, params))
    tokens = [e.token_id for e in events]
    table = (3, 7)
    rows = [spare.forward([Chunk(ids, 0, table)])[0]]
    for i, tok in enumerate(tokens[:-1]):
        rows.append(spare.forward([Chunk([tok], len(ids) + i, table)])[0])
    for ev, logits in zip(events, rows):
        want = torch.log_softmax(logits.float(), -1)
        got = ev.logprobs
        assert got["logprob"] == pytest.approx(float(want[ev.token_id]), abs=1e-4)
        top_ids = [t for t, _ in got["top"]]
        assert top_ids == torch.topk(want, 3).indices.tolist()
        assert [lp for _, lp in got["top"]] == pytest.approx(torch.topk(want, 3).values.tolist(),
                                                              abs=1e-4)
    assert SamplingParams(max_tokens=1).logprobs is None
    assert all(e.logprobs is None for e in engine.stream(ids, SamplingParams(max_tokens=2)))
    assert token_logprobs(torch.tensor([0.0, 0.0]), 1, 0) == {"logprob": pytest.approx(-0.6931, abs=1e-4), "top": []}
    for bad in (-1, 21, True, 1.0):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(logprobs=bad)
