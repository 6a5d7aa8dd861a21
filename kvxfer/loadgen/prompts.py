"""Prompt text for trace requests whose shared hash ids really share a token prefix.

Each hash id maps deterministically (seeded by the id) to a fixed block of words,
``round(512 * length_scale)`` of them. A prompt is its hash ids' blocks joined in
order, cut to ``round(input_length * length_scale)`` words. Words are common,
space-separated lowercase English words, so a BPE tokenizer splits at every space
and two prompts with equal leading hash ids have equal leading tokens (about one
token per word). Different ids give different blocks, so unshared suffixes differ.
"""
from __future__ import annotations

import random

from .trace import BLOCK_TOKENS, TraceRequest

# one-token words in common BPE vocabularies (GPT-2, Llama, SmolLM2)
WORDS = tuple("""
the of and to in is was for on that with as by at from his her they this are have
be not had but one all were when we there can an which their said if do will each
about how up out them then she many some so these would other into has more two
time like him see could no make than first been its who now people my made over
did down only way find use may water long little very after words called just where
most know get through back much before go good new write our used me man too any
day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away
again off went old number great tell men say small every found still between name
should home big give air line set own under read last never us left end along while
might next sound below saw something thought both few those always looked show large
often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head
above kind began almost live page got earth need far hand high year mother light parts
country father let night following picture being study second eyes soon times story
""".split())

ID_BASE = 256  # prompt_ids start here (past a Llama-family vocabulary's special ids)
MAX_HASH_ID = 1 << 21  # prompt_ids' hash ids (the conversation trace's reach 182,789)


class PromptBuilder:
    """Deterministic prompt text for trace requests (see module doc)."""

    def __init__(self, *, length_scale: float = 1.0, seed: int = 0,
                 block_tokens: int = BLOCK_TOKENS, output_scale: float | None = None):
        """``length_scale`` scales prompt lengths and, unless ``output_scale`` is given, output
        lengths too."""
        if not length_scale > 0 or (output_scale is not None and not output_scale > 0):
            raise ValueError("length_scale and output_scale must be > 0")
        self.length_scale = length_scale
        self.output_scale = length_scale if output_scale is None else output_scale
        self.seed = seed
        self.block_words = max(1, round(block_tokens * length_scale))
        self._cache: dict[int, list[str]] = {}

    def block(self, hash_id: int) -> list[str]:
        words = self._cache.get(hash_id)
        if words is None:
            rng = random.Random(f"{self.seed}:{hash_id}")  # str seeds hash stably across runs
            words = [rng.choice(WORDS) for _ in range(self.block_words)]
            self._cache[hash_id] = words
        return words

    def num_words(self, req: TraceRequest) -> int:
        return max(1, round(req.input_length * self.length_scale))

    def max_tokens(self, req: TraceRequest) -> int:
        return max(1, round(req.output_length * self.output_scale))

    def prompt(self, req: TraceRequest) -> str:
        return " ".join(self.words(req))

    def prompt_ids(self, req: TraceRequest) -> list[int]:
        """The prompt as token ids, what the virtual clock runs (it has no tokenizer): as
        many ids as :meth:`prompt` has words, hash id ``h``'s block the run of ids
        ``ID_BASE + h * n ...`` (``n`` words a block), so equal leading hash ids give equal
        leading ids and different ones never match. No words are drawn (a replay of
        thousands of requests builds its prompts in milliseconds)."""
        want, n = self.num_words(req), self.block_words
        ids: list[int] = []
        for hash_id in req.hash_ids:
            if not 0 <= hash_id < MAX_HASH_ID:
                raise ValueError(f"trace hash id {hash_id} outside [0, {MAX_HASH_ID})")
            ids.extend(range(ID_BASE + hash_id * n, ID_BASE + (hash_id + 1) * n))
            if len(ids) >= want:
                return ids[:want]
        # a row with fewer ids than its length needs: ids past every hash id's, unique to it
        row = hash((req.timestamp_ms, req.input_length, len(req.hash_ids))) % (1 << 10)
        base = ID_BASE + MAX_HASH_ID * n + row * want
        if base + want >= 1 << 32:  # the block hash packs ids as 32-bit
            raise ValueError(f"prompt of {want} tokens at length scale {self.length_scale}: "
                             "its ids would pass 2**32")
        ids.extend(range(base, base + want - len(ids)))
        return ids

    def words(self, req: TraceRequest) -> list[str]:
        want = self.num_words(req)
        words: list[str] = []
        for hash_id in req.hash_ids:
            words.extend(self.block(hash_id))
            if len(words) >= want:
                break
        # a trace row with fewer ids than its length needs is padded by a per-row block
        filler = len(req.hash_ids)
        while len(words) < want:
            words.extend(self.block(-1 - hash((req.timestamp_ms, req.input_length, filler)) % (1 << 30)))
            filler += 1
        return words[:want]
