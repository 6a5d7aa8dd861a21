"""Loads the C++ extension ``kvxfer._C`` after the UCX libraries it links.

The ``libucx`` wheel expects ``libucx.load_library()`` before anything that
links ``libucp`` is loaded. UCX's shared-memory transports refuse endpoints with
peer error handling unless ``UCX_MM_ERROR_HANDLING=y``; without it UCX silently
falls back to TCP on one host, so we set it unless the user already chose.
"""
from __future__ import annotations

import os

_C = None


def load():
    """Return the ``kvxfer._C`` module, loading UCX first (idempotent)."""
    global _C
    if _C is None:
        os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
        try:
            import libucx

            libucx.load_library()
        except ImportError:  # a system UCX may still satisfy the link
            pass
        from . import _C as module

        _C = module
    return _C
