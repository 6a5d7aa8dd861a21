"""One request's state: its tokens, block table, progress and sampling state."""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Sequence as Seq

from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..model.detokenize import IncrementalDetokenizer

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no blocks
    PREFILLING = "prefilling"  # blocks allocated, prompt (or recompute) chunks remain
    DECODING = "decoding"  # all tokens but the last are in the cache
    SWAPPED = "swapped"  # preempted by swapping: no blocks, its KV held off the device
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output) and where their KV lives.

    ``block_table[i]`` holds positions ``i*B .. i*B+B-1``. Positions
    ``< num_computed_tokens`` are in the cache; the first ``num_cached_tokens``
    of them came from prefix-cache hits. ``block_hashes[i]`` is the chained
    hash of full block ``i`` once registered with the block manager;
    ``hash_chain`` memoizes every full block's hash, registered or not.

    The prompt is copied; ids that are not plain ``int`` (numpy or torch integers,
    bools) are made plain ints. ``ints_checked=True``: the caller vouches that they
    are plain ints already (the virtual clock's prompts, checked once per request),
    and only the copy is made: the check costs about 40 ns a token.
    """

    def __init__(self, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                 request_id: str | None = None, *, ints_checked: bool = False) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        self.request_id = str(next(_ids)) if request_id is None else str(request_id)
        self.params = params if params is not None else SamplingParams()
        token_ids = list(prompt_token_ids)
        if not ints_checked and set(map(type, token_ids)) != {int}:
            token_ids = list(map(int, token_ids))
        self.token_ids = token_ids
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.hash_chain = None  # BlockManager's HashChain memo of full-block hashes
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None
        self.generator = self.params.make_generator()
        self.detokenizer: IncrementalDetokenizer | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size:(index + 1) * block_size]

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every token (including the one not yet computed)."""
        return -(-len(self.token_ids) // block_size)
