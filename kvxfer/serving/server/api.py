"""OpenAI-compatible request schemas and response bodies.

A request either gets what it asked for or a 400 that names the parameter; no
field is accepted and then ignored:

- implemented: ``model`` (404 when it is not the served model), ``prompt`` (a
  string, a list of strings, token ids or a list of token-id lists: one choice
  per prompt), ``messages`` (text content), ``max_tokens`` (chat also
  ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``n``, ``stream``, ``stream_options.include_usage``, ``logprobs`` (completions:
  an int; chat: a bool with ``top_logprobs``), ``ignore_eos`` (vLLM's extension);
  ``user`` and ``metadata`` are labels and change nothing by definition;
- refused unless at their neutral value (:data:`NEUTRAL`): penalties,
  ``logit_bias``, ``echo``, ``suffix``, ``best_of``, ``response_format`` other
  than ``{"type": "text"}``, ``tools``/``tool_choice``/``functions``, audio,
  predictions, reasoning effort, web search, ``store``, service tiers;
- any other field: 400 (``unknown parameter``).

Types are strict, as the OpenAI API's: ``true`` is not an int, ``"yes"`` not a
bool, ``1.0`` not an int. Wrong types, out-of-range or non-finite numbers
(``NaN``, ``Infinity``) and text that is not valid Unicode (a lone surrogate
such as ``"\\ud800"``) fail validation: the router answers 400 with an
OpenAI-style error body (:func:`error_body`, see :mod:`kvxfer.serving.server.guard`).
"""
from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 8
MAX_SEED = 2**63 - 1
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n in one request
MAX_TOKENS = 4096
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM send this floor instead

# Accepted OpenAI parameters this server does not implement: allowed only at
# these values (absent or null is always fine); anything else is a 400 naming them.
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
}


class Unsupported(ValueError):
    """A parameter this server does not implement was given a non-neutral value."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_text(value: str, what: str) -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogates), else ValueError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogate)") from None
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (benchmarks)
    user: str | None = None  # a label for the caller's own bookkeeping
    # refused unless neutral (NEUTRAL); typed loosely so the refusal, not a type error, answers
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
        return [check_text(s, "stop") for s in stops]

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: only the sampled token's), None: no logprobs."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def check_supported(self) -> None:
        """Raise :class:`Unsupported` for the first non-neutral unimplemented parameter,
        or for a combination the API does not allow."""
        for name in NEUTRAL:
            if name not in type(self).model_fields:
                continue
            value = getattr(self, name)
            if value is None or any(_same(value, ok) for ok in NEUTRAL[name]):
                continue
            if name == "best_of" and _same(value, self.n):
                continue
            allowed = " or ".join(_show(v) for v in NEUTRAL[name]) or "null"
            raise Unsupported(name, f"{name}={_show(value)} is not supported by this server "
                                    f"(allowed: {allowed})")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed with stream=true")

    def sampling(self, stop_token_ids: list[int], index: int = 0) -> dict:
        """The sampling parameters of choice ``index`` as the worker messages carry them.

        A seeded request with ``n > 1`` gives choice ``i`` the seed ``seed + i`` (as
        vLLM does), so the choices are independent samples and each is reproducible.
        """
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return {
            "max_tokens": self.num_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": seed,
            "stop_token_ids": stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": self.num_logprobs,
        }


def _same(value, neutral) -> bool:
    """JSON equality that keeps bools apart from numbers (``True != 1`` here)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _show(value) -> str:
    import json

    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return type(value).__name__


def field_check(field: str, check):
    """A pydantic validator of ``field`` (after its type is checked) that returns
    ``check(value)``; ``check`` raises ValueError for a value the server refuses."""
    return field_validator(field)(classmethod(lambda cls, value: check(value)))


def _check_prompt(value):
    if isinstance(value, list):
        if not value:
            raise ValueError("prompt: an empty list")
        if not isinstance(value[0], int) and len(value) > MAX_CHOICES:
            raise ValueError(f"prompt: at most {MAX_CHOICES} prompts in one request")
    if isinstance(value, str):
        return check_text(value, "prompt")
    if value and isinstance(value[0], str):
        return [check_text(p, "prompt") for p in value]
    return value


def _check_content(value):
    if isinstance(value, list):
        value = "".join(part.text for part in value)
    return check_text(value, "content")


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    _prompt_text = field_check("prompt", _check_prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    # what an echoed assistant message may carry; refused unless null/empty
    name: Any = None
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    _content_text = field_check("content", _check_content)

    def unsupported(self) -> str | None:
        """The first field set to something this server would ignore, else None."""
        for name in ("name", "tool_calls", "function_call", "refusal", "audio", "annotations"):
            if getattr(self, name) not in (None, [], ""):
                return name
        return None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which are refused
    metadata: dict[str, str] | None = None  # a label, as user
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None

    @property
    def num_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().num_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs=true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise Unsupported("max_completion_tokens",
                              "max_tokens and max_completion_tokens disagree; give one")
        for i, m in enumerate(self.messages):
            name = m.unsupported()
            if name is not None:
                raise Unsupported(f"messages[{i}].{name}",
                                  f"messages[{i}].{name} is not supported by this server")


# ---- responses ------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def envelope(rid: str, kind: str, model: str, created: int) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model}


def _floor(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB and not math.isnan(logprob) else MIN_LOGPROB


class LogprobFormatter:
    """OpenAI's ``logprobs`` objects from the workers' per-token reports.

    ``tokens``: ``[(token_id, report), ...]`` where ``report`` is
    :func:`kvxfer.serving.engine.sampling.token_logprobs`' dict. ``text_of(id)``
    and ``bytes_of(id)`` give one token's text and raw bytes.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def bytes_of(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id)

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", "replace")

    def completion(self, tokens: list[tuple[int, dict]], text_offset: int) -> tuple[dict, int]:
        """The completions API's object (``tokens``, ``token_logprobs``,
        ``top_logprobs``: the top alternatives plus the sampled token, ``text_offset``)
        and the offset after these tokens."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, report in tokens:
            text = self.text_of(token_id)
            top = {self.text_of(t): _floor(lp) for t, lp in report["top"]}
            top.setdefault(text, _floor(report["logprob"]))
            out["tokens"].append(text)
            out["token_logprobs"].append(_floor(report["logprob"]))
            out["top_logprobs"].append(top)
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out, text_offset

    def chat(self, tokens: list[tuple[int, dict]]) -> dict:
        """The chat API's object: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``."""
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.text_of(token_id), "logprob": _floor(logprob),
                    "bytes": list(self.bytes_of(token_id))}

        content = [{**entry(t, r["logprob"]), "top_logprobs": [entry(a, lp) for a, lp in r["top"]]}
                   for t, r in tokens]
        return {"content": content, "refusal": None}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, finish_reason: str | None, logprobs: dict | None, *,
                message: dict | None = None, delta: dict | None = None) -> dict:
    body = {"index": index}
    if message is not None:
        body["message"] = message
    if delta is not None:
        body["delta"] = delta
    return {**body, "logprobs": logprobs, "finish_reason": finish_reason}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
