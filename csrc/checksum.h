// Object checksums of the KV store: XXH3-64 over a byte stream given as runs.
#pragma once
#include <cstdint>

namespace kvxfer {

// XXH3-64 (seed 0, default secret) of the concatenation of the runs [addr[i], addr[i] + len[i]): the same
// value however the bytes are split into runs (a slot read in one piece and the same
// object gathered from an engine's tiles agree). Little-endian words.
uint64_t checksum_runs(const int64_t* addr, const int64_t* len, int64_t n);

}  // namespace kvxfer
