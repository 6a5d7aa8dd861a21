"""Benchmark cores behind ``kvxfer bench``: each module measures one thing and
the limit it is compared with (memcpy, raw socket) in the same run."""
