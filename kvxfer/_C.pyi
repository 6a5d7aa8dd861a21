# Type stub of the private extension kvxfer._C (load it through kvxfer._native.load()).
# Each owner of a csrc/bindings.cpp section keeps its part here.
import numpy as np
import numpy.typing as npt

# ---- copy: CPU gather/scatter (kvxfer/kernels/cpu.py validates every argument) ----
def copy_tiles(
    plane_addr: npt.NDArray[np.int64],
    block_stride: npt.NDArray[np.int64],
    outer_stride: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64],
    sizes: tuple[int, int, int],
    row_bytes: int,
    tile_bytes: int,
    wire: int,
    to_wire: bool,
    num_threads: int,
    streaming: bool = False,
) -> None: ...
def memcpy_parallel(dst: int, src: int, nbytes: int, num_threads: int) -> None: ...
