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

from kvxfer.integrations.vllm.proxy import make_app  # noqa: E402

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


LAYERWISE = dict(PARAMS, layerwise=True, remote_ranks=[["127.0.0.1:9", 0, 2], ["127.0.0.1:10", 2, 4]],
                 remote_kv_heads=4)


@pytest.mark.parametrize("stream", [False, True])
def test_layerwise_p_and_d_get_the_request_at_once_with_one_transfer_id(stream):
    """After a P answered "layerwise": true, later requests go to P and D together: D's
    params name P's ranks and the transfer id P is told to send under."""
    seen = []
    with client(upstreams(seen, p_params=LAYERWISE)) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": stream})
            assert r.status_code == 200
    first, second = seen[:2], seen[2:]
    assert [s[1] for s in first] == [8100, 8200]  # P first, then D with P's answer
    p_body = next(b for _, port, _, b in second if port == 8100)
    d_body = next(b for _, port, _, b in second if port == 8200)
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert tid.startswith("kvx-") and d_body["kv_transfer_params"]["remote_request_id"] == tid
    assert d_body["kv_transfer_params"]["remote_ranks"] == LAYERWISE["remote_ranks"]
    assert d_body["kv_transfer_params"]["do_remote_prefill"] is True


def test_layerwise_prefill_failure_fails_the_request():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.port)
        if request.url.port == 8100:
            status = 200 if calls.count(8100) == 1 else 503
            return httpx.Response(status, json={"choices": [{"text": "x"}], "kv_transfer_params": LAYERWISE})
        return httpx.Response(200, json={"choices": [{"text": "abc"}]})

    with client(httpx.MockTransport(handler)) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code in (200, 503)
        # P's failure forgot its layer-by-layer ranks: the next request asks P first again
        calls.clear()
        c.post("/v1/completions", json={"prompt": "hi"})
        assert calls[0] == 8100
