"""``kvxfer proxy`` request flow against stand-in P and D servers (httpx MockTransport):
P gets max_tokens=1, stream=false and do_remote_decode; D gets P's kv_transfer_params
and its stream is relayed chunk by chunk; upstream errors keep their status.
(The real-engine run is tests/test_vllm_pd.py::test_proxy_streams_the_decode_answer.)"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvxfer.integrations.vllm_proxy import make_app  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_addr": "127.0.0.1:9", "remote_request_id": "r-1"}


def upstreams(seen, *, p_params=PARAMS, p_status=200):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, request.url.port, request.url.path, body))
        if request.url.port == 8100:  # P
            return httpx.Response(p_status, json={"choices": [{"text": "x"}], "kv_transfer_params": p_params})
        if body.get("stream"):
            sse = b"".join(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode() for t in "abc")
            return httpx.Response(200, content=sse + b"data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "abc"}]})

    return httpx.MockTransport(handler)


def client(transport):
    return TestClient(make_app(["http://p:8100"], ["http://d:8200"], transport=transport))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_streamed(path):
    seen = []
    with client(upstreams(seen)) as c:
        with c.stream("POST", path, json={"model": "m", "prompt": "hi", "max_tokens": 20, "stream": True,
                                          "max_completion_tokens": 20}) as r:
            body = b"".join(r.iter_raw())
    assert r.status_code == 200 and body.count(b"data: ") == 4
    (_, p_port, p_path, p_body), (_, d_port, d_path, d_body) = seen
    assert (p_port, p_path, d_port, d_path) == (8100, path, 8200, path)
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body["kv_transfer_params"] == PARAMS and d_body["max_tokens"] == 20 and d_body["stream"]


def test_non_streaming_and_upstream_errors():
    seen = []
    with client(upstreams(seen)) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).json() == {"choices": [{"text": "abc"}]}
    with client(upstreams([], p_params=None)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502 and "kv_transfer_params" in r.text
    with client(upstreams([], p_status=400)) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 400
    with pytest.raises(ValueError):
        make_app([], ["http://d:1"])
