"""Byte-level BPE tokenizer and chat template, built from GGUF metadata.

Reads ``tokenizer.ggml.{tokens,merges,token_type,bos_token_id,eos_token_id}``
and ``tokenizer.chat_template``. Control tokens (type 3, e.g. ``<|im_start|>``)
are special: they encode from their literal text and are skipped when decoding
with ``skip_special_tokens=True``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from gguf import GGUFReader

_CONTROL = 3
# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` (llama.cpp's names): whether
# digits are split one by one before the GPT-2 byte-level regex.
_SPLIT_DIGITS = {"smollm", "llama3", "llama-bpe", "qwen2", "deepseek-llm"}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer:
    """Example::

        tok = Tokenizer.from_gguf(reader)
        ids = tok.encode("Hello")                  # list[int]
        tok.decode(ids) == "Hello"
        ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 *, bos_id: int | None, eos_id: int | None, chat_template: str | None = None,
                 pre: str = "gpt2", add_bos: bool = False) -> None:
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        if len(tokens) != len(token_types):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        self._tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _SPLIT_DIGITS:
            self._tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            self._tok.pre_tokenizer = byte_level
        self._tok.decoder = decoders.ByteLevel()
        specials = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self.special_ids = frozenset(vocab[t] for t in specials)
        self._tokens = list(tokens)
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, reader: "GGUFReader") -> "Tokenizer":
        from .gguf_loader import metadata

        kind = metadata(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported tokenizer model {kind!r}: only byte-level BPE (gpt2)")
        return cls(
            metadata(reader, "tokenizer.ggml.tokens"), metadata(reader, "tokenizer.ggml.merges"),
            metadata(reader, "tokenizer.ggml.token_type"),
            bos_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=metadata(reader, "tokenizer.ggml.eos_token_id"),
            chat_template=metadata(reader, "tokenizer.chat_template"),
            pre=metadata(reader, "tokenizer.ggml.pre", "gpt2"),
            add_bos=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        )

    def save_json(self, path: str) -> None:
        """Write the tokenizer as a Hugging Face ``tokenizer.json`` (vocab, merges,
        pre-tokenizer, decoder, special tokens)."""
        self._tok.save(str(path))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special-token text such as ``<|im_end|>`` maps to its id)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on a
        # worker thread then leaves the caller's event loop free.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a control token: its literal text in UTF-8).

        A token may hold part of a multi-byte character; :meth:`decode` of the
        whole output is the text, this is what the model chose at one position.
        """
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {token_id}")
        token = self._tokens[int(token_id)]
        if int(token_id) in self.special_ids:
            return token.encode("utf-8")
        alphabet = _BYTE_LEVEL
        return bytes(alphabet[c] for c in token if c in alphabet)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text for chat ``messages`` (``[{"role": ..., "content": ...}]``)."""
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError("each message needs str 'role' and 'content'")
        if not messages:
            raise ValueError("a chat needs at least one message")
        if self.chat_template:
            try:
                import jinja2.sandbox
            except ImportError:
                pass
            else:
                env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                                   lstrip_blocks=True)
                return env.from_string(self.chat_template).render(
                    messages=list(messages), add_generation_prompt=add_generation_prompt,
                    bos_token="", eos_token="")
        return render_chatml(messages, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                           add_bos=False)


SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_chatml(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                  default_system: str | None = SMOLLM_SYSTEM) -> str:
    """ChatML as in SmolLM2's template, without jinja2: a default system turn
    first unless the chat starts with one, then ``<|im_start|>role\\ncontent<|im_end|>\\n``."""
    parts = []
    if default_system is not None and messages and messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
