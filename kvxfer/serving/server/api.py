"""OpenAI-compatible request schemas and response bodies.

Only the fields the reference server implements are declared; unknown fields
are ignored (clients send many). Wrong types, out-of-range or non-finite numbers
(``NaN``, ``Infinity``) and text that is not valid Unicode (a lone surrogate such
as ``"\\ud800"``) fail validation: the router answers 400 with an OpenAI-style
error body (:func:`error_body`, see :mod:`kvxfer.serving.server.guard`).
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 8
MAX_SEED = 2**63 - 1


def check_text(value: str, what: str) -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogates), else ValueError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogate)") from None
    return value


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (benchmarks)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
        return [check_text(s, "stop") for s in stops]

    def sampling(self, stop_token_ids: list[int]) -> dict:
        """The sampling parameters as the worker messages carry them."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop_token_ids": stop_token_ids,
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value):
        return check_text(value, "prompt") if isinstance(value, str) else value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content_text(cls, value):
        return check_text(value, "content")


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def _envelope(rid: str, kind: str, model: str, created: int) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model}


def now() -> int:
    return int(time.time())


def _one_choice(rid: str, obj: str, model: str, created: int, finish_reason: str | None,
                **content) -> dict:
    body = _envelope(rid, obj, model, created)
    body["choices"] = [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}]
    return body


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish_reason: str | None) -> dict:
    return _one_choice(rid, "text_completion", model, created, finish_reason, text=text)


def chat_chunk(rid: str, model: str, created: int, delta: dict,
               finish_reason: str | None) -> dict:
    return _one_choice(rid, "chat.completion.chunk", model, created, finish_reason, delta=delta)


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str,
                    usage: dict, extra: dict) -> dict:
    return {**_one_choice(rid, "text_completion", model, created, finish_reason, text=text),
            "usage": usage, "kvxfer": extra}


def chat_body(rid: str, model: str, created: int, text: str, finish_reason: str,
              usage: dict, extra: dict) -> dict:
    message = {"role": "assistant", "content": text}
    return {**_one_choice(rid, "chat.completion", model, created, finish_reason, message=message),
            "usage": usage, "kvxfer": extra}


def error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}
