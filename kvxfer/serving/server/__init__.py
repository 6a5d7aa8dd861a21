"""The server: the OpenAI-compatible router and its side of the worker processes.

``router`` (HTTP, SSE, ``guard``, ``api``; uvicorn's connection limits in
``http_limits``) -> ``dispatch`` (per request) ->
``launcher`` (local workers) or ``remote`` (workers found through discovery), over
the messages of :mod:`kvxfer.serving.channel`; ``serve_config`` is the frozen server config;
``rebalancer`` (``--adaptive``) moves workers between prefill and decode as
``adaptive_policy`` (a pure function of observed stats) decides.
"""
