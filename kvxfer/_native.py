"""Loads the C++ extension ``kvxfer._C`` after the UCX libraries it links.

The ``libucx`` wheel expects ``libucx.load_library()`` before anything that
links ``libucp`` is loaded. UCX's shared-memory transports refuse endpoints with
peer error handling unless ``UCX_MM_ERROR_HANDLING=y``; without it UCX silently
falls back to TCP on one host, so we set it unless the user already chose, and only
where ``UCX_TLS`` lets UCX use them: with ``UCX_TLS=tcp`` (say) UCX would print a
warning about an unused variable on stdout, ahead of what ``kvxfer store`` and the
workers print there.
"""
from __future__ import annotations

import os

_C = None

# UCX_TLS names that bring in the shared-memory (mm) transports MM_ERROR_HANDLING configures
_MM_ALL = {"all", "sm", "shm", "mm"}
_MM_EACH = {"posix", "sysv", "xpmem"}


def uses_shared_memory(tls: str | None) -> bool:
    """Whether a ``UCX_TLS`` value (None: unset) lets UCX use its shared-memory
    transports: any of ``all``, ``sm``/``shm``, ``mm``, ``posix``, ``sysv``, ``xpmem``
    listed, or a ``^``-negated list that leaves one of them out."""
    if tls is None:
        return True
    names = [t.strip().lower() for t in tls.split(",") if t.strip()]
    if not names:
        return True  # empty: UCX's default, all
    if names[0].startswith("^"):
        excluded = {names[0][1:].strip(), *names[1:]}
        return not (excluded & _MM_ALL or _MM_EACH <= excluded)
    return bool({n.split(":")[0] for n in names} & (_MM_ALL | _MM_EACH))


def load():
    """Return the ``kvxfer._C`` module, loading UCX first (idempotent)."""
    global _C
    if _C is None:
        if uses_shared_memory(os.environ.get("UCX_TLS")):
            os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
        try:
            import libucx

            libucx.load_library()
        except ImportError:  # a system UCX may still satisfy the link
            pass
        from . import _C as module

        _C = module
    return _C
