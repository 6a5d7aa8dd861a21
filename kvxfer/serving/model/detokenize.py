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

    ``output_ids`` grows by appending. Each call decodes only the ids since the last
    complete character plus the few before them (their text is the context a decoder
    may need, e.g. a leading-space rule), not the whole output: a stream of n tokens
    costs O(n), not O(n^2).
    """

    def __init__(self, tokenizer: "Tokenizer", stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self.text = ""  # emitted so far
        self.stopped = False
        self._decoded = ""  # the text of output_ids[:_read]: complete characters only
        self._prefix = 0    # the window decoded each call starts here (context)...
        self._read = 0      # ...and its text past here is new
        self._prefix_text = ""  # the text of output_ids[_prefix:_read] decoded alone

    def _full_text(self, output_ids: Sequence[int]) -> str:
        """The text of all of ``output_ids`` (as one decode of them), from a short window."""
        if len(output_ids) < self._read:  # not the list grown: start over
            self._decoded, self._prefix, self._read, self._prefix_text = "", 0, 0, ""
        window = self._tokenizer.decode(output_ids[self._prefix:])
        if window.startswith(self._prefix_text):
            full = self._decoded + window[len(self._prefix_text):]
        else:  # the context decodes differently alone: decode it all
            full = self._tokenizer.decode(output_ids)
        if not full.endswith("\ufffd"):  # ends on a complete character: move the window
            self._decoded, self._read = full, len(output_ids)
            self._prefix = max(0, self._read - 4)  # a few tokens of context
            self._prefix_text = self._tokenizer.decode(output_ids[self._prefix:self._read])
        return full

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
        full = self._full_text(output_ids)
        cut = min((i for i in (full.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(full) if final else len(full) - self._holdback(full)
        delta = full[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta
