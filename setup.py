"""Builds the private extension ``kvxfer._C`` from ``csrc/``.

UCX comes from the ``libucx-cu12`` wheel (headers and libraries inside the
``libucx`` package); at run time ``kvxfer._native`` calls
``libucx.load_library()`` before importing ``_C``, and the rpath below lets the
loader find the same libraries when the wheel sits next to kvxfer.
"""
import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


def _libucx_root() -> str:
    import libucx  # provided by [build-system].requires

    return os.path.dirname(libucx.__file__)


ucx = _libucx_root()
ext = Pybind11Extension(
    "kvxfer._C",
    sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc", os.path.join(ucx, "include")],
    library_dirs=[os.path.join(ucx, "lib")],
    libraries=["ucp", "ucs", "dl", "pthread"],
    runtime_library_dirs=["$ORIGIN/../libucx/lib"],
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
    extra_link_args=["-pthread"],
    cxx_std=17,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
