// The only file that talks to Python: exports, nothing else.
// Each concept lives in its own translation unit and is bound here.
// C++ exceptions (kvxfer::Error subclasses, see errors.h) are translated to
// the kvxfer.KVXferError hierarchy by the Python wrappers.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "kvxfer native layer: CPU gather/scatter, memory registration, UCX engine";

    // ---- copy: CPU gather/scatter (owner: pack/unpack) ----

    // ---- registration and transfer engine (owner: memory/transport) ----
}
