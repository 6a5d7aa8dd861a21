// CPU gather/scatter of paged-KV tiles between engine memory and the wire format.
// Pure C++ (no Python); bound in bindings.cpp. Callers validate every address
// range first (kvxfer/runs.py): these functions trust their inputs.
#pragma once
#include <cstdint>

namespace kvxfer {

// One pack/unpack: `num_planes` wire planes, `num_ids` blocks each. Tile of plane p,
// block i starts at plane_addr[p] + ids[i] * block_stride[p] in engine memory and at
// wire + (p * num_ids + i) * tile_bytes in the wire buffer; it is S0 x S1 x S2 rows of
// row_bytes, row (a, b, c) at a*outer_stride[3p] + b*outer_stride[3p+1] + c*outer_stride[3p+2].
struct TileCopy {
    const int64_t* plane_addr;
    const int64_t* block_stride;
    const int64_t* outer_stride;  // [num_planes * 3]
    int64_t num_planes;
    const int64_t* ids;
    int64_t num_ids;
    int64_t sizes[3];
    int64_t row_bytes;
    int64_t tile_bytes;
    uintptr_t wire;
    bool streaming;  // non-temporal stores (for copies much larger than the caches)
};

// to_wire: engine -> wire (pack), else wire -> engine (unpack). Splits tiles across
// `num_threads` threads (1 = calling thread only). Returns when all bytes are copied.
void copy_tiles(const TileCopy& job, bool to_wire, int num_threads);

// n bytes src -> dst: memcpy, or with streaming non-temporal stores (from 256 bytes);
// a thread calls fence(true) after its last streaming copy, before it reports done.
void copy_bytes(char* dst, const char* src, int64_t n, bool streaming);
void fence(bool streaming);
// Batches from this size are copied with streaming stores (the pack kernels'
// kvxfer.kernels.STREAM_BYTES and the same-host shared-memory path).
constexpr int64_t kStreamBytes = int64_t{32} << 20;

// Contiguous memcpy split across threads: the baseline the benchmark compares with.
void memcpy_parallel(uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads);

}  // namespace kvxfer
