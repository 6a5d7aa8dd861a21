"""The OpenAI API of a real ``kvxfer serve``, through the ``openai`` client.

What it implements (``n``, list prompts, ``logprobs``/``top_logprobs`` checked
against the model run here, a 404 for an unknown model), what it refuses by
name, strict types, aborted streams in the metrics, and the HTTP connection
limits: half-sent headers and stalled bodies are closed while ``/health`` keeps
answering. One disaggregated server (1 prefill + 1 decode worker) with short
header and body deadlines for the module.
"""
from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from serving_server import Server
from waiting import until, until_closed

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
CLOSED_WITHIN_S = 60.0  # generous: "closed", not "closed fast"
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server():
    s = Server("--prefill", "1", "--decode", "1", "--header-timeout", str(HEADER_TIMEOUT_S),
               "--body-timeout", str(BODY_TIMEOUT_S), "--keep-alive-timeout", "1")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 6)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


# ---- n and list prompts ---------------------------------------------------------------


def test_n_greedy_gives_n_identical_choices(client):
    one = _complete(client, "The sea is")
    three = _complete(client, "The sea is", n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # one prompt, counted once
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0, n=2)
    assert len({c.message.content for c in chat.choices}) == 1 and len(chat.choices) == 2


def test_n_sampled_choices_are_independent_reproducible_samples(client):
    kw = {"temperature": 1.0, "max_tokens": 8, "seed": 11}
    three = [c.text for c in _complete(client, "My favourite food is", n=3, **kw).choices]
    again = [c.text for c in _complete(client, "My favourite food is", n=3, **kw).choices]
    assert three == again
    # choice i is sampled with seed + i (as vLLM): the same as a single request with that seed
    for i, text in enumerate(three):
        single = _complete(client, "My favourite food is", **{**kw, "seed": 11 + i})
        assert single.choices[0].text == text
    assert len(set(three)) > 1, three


def test_list_prompts_get_one_choice_each(client):
    prompts = ["Hello", "Paris is"]
    singles = [_complete(client, p).choices[0].text for p in prompts]
    both = _complete(client, prompts)
    assert [(c.index, c.text) for c in both.choices] == list(enumerate(singles))
    # with n: prompt-major indices, as vLLM (index = prompt * n + i)
    four = _complete(client, prompts, n=2)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.text for c in four.choices] == [singles[0]] * 2 + [singles[1]] * 2
    ids = [_complete(client, [p], max_tokens=1).usage.prompt_tokens for p in prompts]
    assert four.usage.prompt_tokens == sum(ids)


def test_token_id_prompt_lists(client):
    a = _complete(client, [1, 2, 3, 4])
    both = _complete(client, [[1, 2, 3, 4], [5, 6, 7]])
    assert len(both.choices) == 2 and both.choices[0].text == a.choices[0].text


def test_streamed_choices_carry_their_index(server):
    events = server.stream("/v1/completions", {"prompt": ["Hello", "Paris is"], "n": 2,
                                               "max_tokens": 4, "temperature": 0})
    chunks = [e for e in events[:-1]]
    texts = {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    full = server.complete(["Hello", "Paris is"], n=2, max_tokens=4)
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    finals = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finals) == [0, 1, 2, 3]


# ---- logprobs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(server):
    """The model run in this process, in the workers' matmul dtype: ``logprobs(prompt_ids,
    output_ids)`` -> ``log_softmax`` rows ``[len(output_ids), vocab]``."""
    from kvxfer.serving.model.attention import Chunk
    from kvxfer.serving.model.model import LlamaModel

    matmul = server.health()["workers"][0]["matmul"]
    model = LlamaModel.from_gguf(None, num_blocks=32, matmul_dtype=matmul)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (--threads 1)

    def logprobs(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        table = tuple(range(8))
        rows = [model.forward([Chunk(prompt_ids, 0, table)])[0]]
        for i, tok in enumerate(output_ids[:-1]):
            rows.append(model.forward([Chunk([tok], len(prompt_ids) + i, table)])[0])
        return torch.log_softmax(torch.stack(rows).float(), -1)

    yield logprobs
    torch.set_num_threads(threads)


def test_completion_logprobs_are_the_models_log_softmax(client, reference):
    prompt = [504, 3575, 282, 4649, 314]  # token ids: no tokenizer between here and the model
    r = _complete(client, prompt, max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    output_ids = r.model_extra["kvxfer"]["token_ids"]
    want = reference(prompt, output_ids)
    assert lp.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(output_ids)],
                                              abs=2e-3)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i, top in enumerate(lp.top_logprobs):
        assert lp.tokens[i] in top and len(top) <= 4  # the top 3 plus the sampled token
        best = torch.topk(want[i], 3)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best.values.tolist(), abs=2e-3)
    # streamed: the same values, chunk by chunk
    streamed = []
    for chunk in _complete(client, prompt, max_tokens=5, logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs


def test_chat_logprobs_and_top_logprobs(client):
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
          "top_logprobs": 2}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the best
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None
    none = client.chat.completions.create(**{**kw, "top_logprobs": 0})
    assert all(e.top_logprobs == [] for e in none.choices[0].logprobs.content)


# ---- refusals and errors ----------------------------------------------------------------


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    assert err.value.param == "model" and "nope" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="x", max_tokens=2)


@pytest.mark.parametrize("param,value", [
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("frequency_penalty", 0.5),
    ("logit_bias", {"1": 5}),
])
def test_unimplemented_parameters_are_refused_by_name(client, param, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **{param: value})
    assert err.value.param == param and param in err.value.message


def test_types_are_strict(client):
    for kw in ({"max_tokens": True}, {"stream": "yes"}, {"n": 2.0}, {"temperature": "0"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", **{"max_tokens": 2, **kw})
        assert err.value.param == next(iter(kw)), err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"top_k": 4})
    assert err.value.param == "top_k" and "unknown parameter" in err.value.message


def _requests_total(server, outcome: str) -> float:
    m = re.search(rf'kvxfer_requests_total\{{outcome="{outcome}"\}} ([0-9.e+]+)',
                  server.client.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def test_a_client_aborted_stream_is_counted(server):
    before = _requests_total(server, "aborted")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: hang up
    until(lambda: _requests_total(server, "aborted") == before + 1 or None,
          "the aborted stream counted", timeout=60)
    until(lambda: all(w["inflight"] == 0 for w in server.health()["workers"]) or None,
          "the workers dropped the aborted request", timeout=60)


# ---- connection limits ------------------------------------------------------------------


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=CLOSED_WITHIN_S)


def _half_headers(server) -> socket.socket:
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    return s


def _stalled_body(server) -> socket.socket:
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    return s


def test_half_sent_headers_and_stalled_bodies_are_closed(server):
    silent = [_connect(server) for _ in range(20)]
    half = [_half_headers(server) for _ in range(100)]
    stalled = [_stalled_body(server) for _ in range(30)]
    assert server.client.get("/health", timeout=30).status_code == 200
    deadline = time.monotonic() + CLOSED_WITHIN_S
    for s in silent + half:
        until_closed(s, deadline)
    for s in stalled:
        reply = until_closed(s, deadline)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    # an idle keep-alive connection is closed too (--keep-alive-timeout)
    s = _connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert until_closed(s, time.monotonic() + CLOSED_WITHIN_S).startswith(b"HTTP/1.1 200")


def test_health_keeps_answering_during_a_reconnecting_flood(server):
    stop = threading.Event()
    opened = [0]

    def flood(make) -> None:  # keep 25 slow connections open, replacing each one closed
        socks = []
        while not stop.is_set():
            while len(socks) < 25 and not stop.is_set():
                try:
                    socks.append(make(server))
                    opened[0] += 1
                except OSError:
                    time.sleep(0.05)
            for s in list(socks):
                s.setblocking(False)
                try:
                    if s.recv(4096) == b"":
                        socks.remove(s)
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    socks.remove(s)
                    s.close()
            time.sleep(0.05)
        for s in socks:
            s.close()

    threads = [threading.Thread(target=flood, args=(make,), daemon=True)
               for make in (_half_headers, _half_headers, _stalled_body, _stalled_body)]
    for t in threads:
        t.start()
    try:
        until(lambda: opened[0] >= 100 or None, "the flood open", timeout=60)
        statuses = []
        end = time.monotonic() + 3 * HEADER_TIMEOUT_S  # through several rounds of closing
        while time.monotonic() < end:
            statuses.append(server.client.get("/health", timeout=30).status_code)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert statuses and set(statuses) == {200}, statuses
    assert opened[0] > 100  # the server closed slow connections during the flood
    r = server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
