// The only file that talks to Python: exports, nothing else.
// Each concept lives in its own translation unit and is bound here.
// C++ exceptions (kvxfer::Error subclasses, see errors.h) are translated to
// the kvxfer.KVXferError hierarchy by the Python wrappers.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "copy.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "kvxfer native layer: CPU gather/scatter, memory registration, UCX engine";

    // ---- copy: CPU gather/scatter (owner: pack/unpack) ----
    {
        using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
        m.def(
            "copy_tiles",
            [](I64 plane_addr, I64 block_stride, I64 outer_stride, I64 ids, std::array<int64_t, 3> sizes,
               int64_t row_bytes, int64_t tile_bytes, uintptr_t wire, bool to_wire, int num_threads) {
                const int64_t planes = plane_addr.size();
                if (block_stride.size() != planes || outer_stride.size() != 3 * planes)
                    throw py::value_error("copy_tiles: plane table sizes disagree");
                if (row_bytes <= 0 || tile_bytes != sizes[0] * sizes[1] * sizes[2] * row_bytes)
                    throw py::value_error("copy_tiles: tile geometry is inconsistent");
                kvxfer::TileCopy job{plane_addr.data(), block_stride.data(), outer_stride.data(), planes,
                                     ids.data(), static_cast<int64_t>(ids.size()),
                                     {sizes[0], sizes[1], sizes[2]}, row_bytes, tile_bytes, wire};
                py::gil_scoped_release release;
                kvxfer::copy_tiles(job, to_wire, num_threads);
            },
            py::arg("plane_addr"), py::arg("block_stride"), py::arg("outer_stride"), py::arg("ids"),
            py::arg("sizes"), py::arg("row_bytes"), py::arg("tile_bytes"), py::arg("wire"), py::arg("to_wire"),
            py::arg("num_threads"),
            "Gather (to_wire) or scatter KV tiles by a validated plan; raw addresses, GIL released.");
        m.def(
            "memcpy_parallel",
            [](uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads) {
                if (nbytes < 0) throw py::value_error("memcpy_parallel: negative size");
                py::gil_scoped_release release;
                kvxfer::memcpy_parallel(dst, src, nbytes, num_threads);
            },
            py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
            "Contiguous memcpy split across threads (benchmark baseline); raw addresses, GIL released.");
    }

    // ---- registration and transfer engine (owner: memory/transport) ----
}
