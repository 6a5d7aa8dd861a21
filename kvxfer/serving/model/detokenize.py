"""Incremental detokenization with stop strings, for streaming text deltas."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Text that could still become a stop string, or an incomplete UTF-8
    character, is held back until it is decided. Invariant: the concatenated
    deltas equal :attr:`text`, the output up to (not including) any stop string.
    """

    def __init__(self, tokenizer: "Tokenizer", stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self.text = ""  # emitted so far
        self.stopped = False

    def _holdback(self, full: str) -> int:
        if full.endswith("\ufffd"):
            return 1 + self._holdback(full[:-1]) if full[:-1] else 1
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(full)), keep, -1):
                if full.endswith(s[:k]):
                    keep = k
                    break
        return keep

    def update(self, output_ids: Sequence[int], *, final: bool = False) -> str:
        """New text since the last call; sets :attr:`stopped` when a stop string appears."""
        if self.stopped:
            return ""
        full = self._tokenizer.decode(output_ids)
        cut = min((i for i in (full.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(full) if final else len(full) - self._holdback(full)
        delta = full[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta
