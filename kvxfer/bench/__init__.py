"""Benchmark cores behind ``kvxfer bench``: each module measures one thing and
the limit it is compared with (memcpy, raw socket) in the same run.

They are the ``kvxfer bench`` entry point's, so they build their agents and backends
with :meth:`kvxfer.AgentConfig.from_env`: a ``KVXFER_*`` variable applies to a
measured agent as it does to a user's entry point."""
