"""The router's HTTP edge, in process: bad input, API key, body limit, tokenization off the loop.

The app is the real one (``create_app``) with a real :class:`Router` (tokenizer
from the embedded GGUF) whose workers are not started: every request here is
decided before a worker would be asked (no live worker: 503), and ``/health``
answers ``down``.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from kvxfer.serving.server.router import Router, create_app
from kvxfer.serving.server.serve_config import ServeConfig

KEY = "sk-test-0123456789abcdef"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def app():
    config = ServeConfig(api_key=KEY, max_body_bytes=LIMIT)
    app = create_app(config)
    router = Router(config)
    app.state.router_state["router"] = router
    try:
        yield app
    finally:
        router.close()


def call(app, method: str, path: str, *, key: str | None = KEY, **kw) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        headers = kw.pop("headers", {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await asyncio.wait_for(client.request(method, path, headers=headers, **kw), 60)

    return asyncio.run(main())


def assert_openai_error(r: httpx.Response, status: int, kind: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    err = json.loads(r.content)["error"]
    assert err["type"] == kind and err["code"] == status and err["message"], err


RAW_BAD_BODIES = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": -Infinity}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": [1]}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "seed": -1}'),
    ("/v1/completions", b'{"prompt": "x", "seed": 1e400}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}'),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}'),
    ("/v1/completions", b'{"prompt": [1, "two"]}'),
    ("/v1/completions", b'{"prompt": "x"'),
    ("/v1/completions", b'[1, 2, 3]'),
    ("/v1/completions", b'\xff\xfe not utf-8'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"messages": [], "temperature": NaN}'),
]


@pytest.mark.parametrize("path,body", RAW_BAD_BODIES)
def test_bad_input_is_a_4xx_with_an_openai_error(app, path, body):
    r = call(app, "POST", path, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)


def test_api_key_guards_v1_and_metrics_not_health(app):
    body = {"prompt": [1, 2], "max_tokens": 1}
    for key in (None, "", "wrong", KEY + "x", KEY[:-1]):
        r = call(app, "POST", "/v1/completions", key=key, json=body)
        assert_openai_error(r, 401, "authentication_error")
        assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(call(app, "GET", "/v1/models", key=None), 401, "authentication_error")
    assert_openai_error(call(app, "GET", "/metrics", key="nope"), 401, "authentication_error")
    r = call(app, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"}, key=None)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert call(app, "GET", "/metrics").status_code == 200
    # /health stays open (503 here: the workers of this in-process app never started)
    r = call(app, "GET", "/health", key=None)
    assert r.status_code == 503 and r.json()["status"] == "down"


def test_body_limit_by_length_and_by_stream(app):
    big = json.dumps({"prompt": "word " * (LIMIT // 5 + 10)}).encode()
    assert len(big) > LIMIT
    assert_openai_error(call(app, "POST", "/v1/completions", content=big,
                             headers={"Content-Type": "application/json"}), 413)

    async def chunks():  # no Content-Length: the limit applies while the body arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_openai_error(call(app, "POST", "/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"}), 413)
    assert_openai_error(call(app, "POST", "/v1/completions", content=b"{}",
                             headers={"Content-Type": "application/json",
                                      "Content-Length": "x"}), 400)
    small = json.dumps({"prompt": "word " * 100, "max_tokens": 1}).encode()
    r = call(app, "POST", "/v1/completions", content=small,
             headers={"Content-Type": "application/json"})
    assert r.status_code == 503 and "no live" in r.json()["error"]["message"]  # past the limit


class _GatedCodec:
    """The real codec, but ``encode`` waits for the test's go-ahead (bounded)."""

    def __init__(self, codec):
        self._codec = codec
        self.entered, self.release, self.finished = (threading.Event() for _ in range(3))

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def encode(self, text):
        self.entered.set()
        self.release.wait(15)
        try:
            return self._codec.encode(text)
        finally:
            self.finished.set()


def test_tokenization_does_not_block_the_event_loop(app):
    router = app.state.router_state["router"]
    gated = router.codec = _GatedCodec(router.codec)

    async def main():
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://router",
                                     headers=headers) as client:
            slow = asyncio.create_task(client.post("/v1/completions",
                                                   json={"prompt": "hello", "max_tokens": 1}))
            assert await asyncio.to_thread(gated.entered.wait, 30)
            health = await asyncio.wait_for(client.get("/health"), 30)
            answered_during_encode = not gated.finished.is_set()
            gated.release.set()
            done = await asyncio.wait_for(slow, 60)
            return health, answered_during_encode, done

    try:
        health, answered_during_encode, done = asyncio.run(main())
    finally:
        router.codec = gated._codec
        gated.release.set()
    assert health.status_code == 503 and answered_during_encode
    assert done.status_code == 503  # no started workers


# Strict types, as the OpenAI API: a bool is not an int, a string not a bool, 1.0 not an int.
STRICT_TYPES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": "0"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": False}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
     "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1.0},
     "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", STRICT_TYPES)
def test_types_are_strict(app, path, body, param):
    r = call(app, "POST", path, json=body)
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == param, r.json()


CHAT_X = [{"role": "user", "content": "x"}]
# Accepted OpenAI parameters this server does not implement: a 400 naming them, never ignored.
REFUSED = [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": -1}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"top_k": 5}, "top_k"),  # vLLM's, not implemented: unknown
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"response_format": {"type": "text"}}, "response_format"),  # chat only
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED)
def test_unimplemented_parameters_are_refused_by_name(app, path, extra, param):
    base = {"messages": CHAT_X} if "chat" in path else {"prompt": "x"}
    r = call(app, "POST", path, json={**base, "max_tokens": 1, **extra})
    assert_openai_error(r, 400)
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err


def test_neutral_values_of_unimplemented_parameters_pass(app):
    """What changes nothing is accepted: the request reaches dispatch (503: no workers here)."""
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "modalities": ["text"], "store": False, "service_tier": "auto", "user": "me",
               "metadata": {"k": "v"}, "parallel_tool_calls": True, "seed": 1,
               "model": "SmolLM2-135M-Instruct", "max_completion_tokens": 1}
    r = call(app, "POST", "/v1/chat/completions", json={"messages": CHAT_X, **neutral})
    assert r.status_code == 503, r.text
    r = call(app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1, "echo": False,
                                                  "best_of": 2, "n": 2, "suffix": None})
    assert r.status_code == 503, r.text


def test_unknown_model_is_a_404(app):
    r = call(app, "POST", "/v1/completions", json={"prompt": "x", "model": "nope"})
    assert_openai_error(r, 404)
    assert r.json()["error"]["param"] == "model" and "nope" in r.json()["error"]["message"]
    r = call(app, "POST", "/v1/chat/completions", json={"messages": CHAT_X, "model": "gpt-4o"})
    assert_openai_error(r, 404)


def test_too_many_choices_are_refused(app):
    r = call(app, "POST", "/v1/completions", json={"prompt": ["a"] * 8, "n": 9})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "n"
    assert_openai_error(call(app, "POST", "/v1/completions", json={"prompt": []}), 400)
    r = call(app, "POST", "/v1/completions", json={"prompt": ["a"] * 65})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "prompt"
    # a long token-id prompt is one prompt, not 100 (503: it reached dispatch)
    assert call(app, "POST", "/v1/completions", json={"prompt": [1] * 100}).status_code == 503


def test_a_stalled_body_gets_408_and_the_connection_closed():
    """HTTPGuard alone, over ASGI: part of the body, then nothing."""
    from kvxfer.serving.server.guard import HTTPGuard

    called = []

    async def app_(scope, receive, send):
        called.append(scope["path"])

    guard = HTTPGuard(app_, api_key=None, body_timeout_s=0.2)

    async def main():
        parts = [{"type": "http.request", "body": b'{"prompt"', "more_body": True}]
        sent = []

        async def receive():
            if parts:
                return parts.pop()
            await asyncio.sleep(60)  # the rest never comes

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "path": "/v1/completions", "headers": []}
        await asyncio.wait_for(guard(scope, receive, send), 30)
        return sent

    sent = asyncio.run(main())
    assert not called and sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == 408
    with pytest.raises(ValueError):
        HTTPGuard(app_, api_key=None, body_timeout_s=float("inf"))
