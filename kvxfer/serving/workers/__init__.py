"""Worker processes of the reference server: prefill, decode, colocated.

Each runs ``python -m kvxfer.serving.workers --role ...`` (see :mod:`.main`),
owns one model replica and KV pool, and talks to the router over the socket
pair of :mod:`kvxfer.serving.channel.ipc`. Prefill and decode workers each own one
:class:`kvxfer.Agent`; KV moves between them through it, never through the router.
"""
