"""The router's text side: tokenizer, chat template, stop tokens, context length.

Only the GGUF metadata is read (memory-mapped), never the weights: the router
process stays small and starts fast.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# end-of-turn markers of common chat templates; whichever the vocabulary has stop generation
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


@dataclass(frozen=True)
class TextCodec:
    tokenizer: Any  # kvxfer.serving.model.tokenizer.Tokenizer
    model_name: str
    max_position: int
    stop_token_ids: list[int]

    @classmethod
    def load(cls, model_path: str | None) -> "TextCodec":
        from ..model.gguf_loader import default_model_path, metadata, open_gguf, read_model_config
        from ..model.tokenizer import Tokenizer

        path = model_path or default_model_path()
        reader = open_gguf(path)
        tokenizer = Tokenizer.from_gguf(reader)
        config = read_model_config(reader)
        name = os.path.basename(path).split(".")[0]
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        index = {t: i for i, t in enumerate(tokens)}
        stops = {index[t] for t in _END_TOKENS if t in index}
        if tokenizer.eos_id is not None:
            stops.add(int(tokenizer.eos_id))
        return cls(tokenizer, str(name), config.max_position, sorted(stops))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)
