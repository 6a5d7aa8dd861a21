"""Test-wide setup.

Without CUDA the Triton kernels run in the interpreter: TRITON_INTERPRET must be
set before ``triton`` is first imported, so it is set here, at collection time.
"""
import os


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
