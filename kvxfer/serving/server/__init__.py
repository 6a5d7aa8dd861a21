"""The server: the OpenAI-compatible router and its side of the worker processes.

``router`` (HTTP, SSE, ``guard``, ``api``) -> ``dispatch`` (per request) ->
``launcher`` (local workers) or ``remote`` (workers found through discovery), over
``ipc`` / ``netchannel`` messages; ``serve_config`` is the frozen server config.
"""
