// Object checksums of the KV store: XXH3-64 over a byte stream given as runs.
#pragma once
#include <cstdint>

namespace kvxfer {

// XXH3-64 (seed 0, default secret) of the concatenation of the runs [addr[i], addr[i] + len[i]): the same
// value however the bytes are split into runs (a slot read in one piece and the same
// object gathered from an engine's tiles agree). Little-endian words.
uint64_t checksum_runs(const int64_t* addr, const int64_t* len, int64_t n);

// The same checksum of the runs `hashed`, copying each run between hashed[i] and
// other[i] (len[i] bytes) as it is hashed (in the hashing loop, or a chunk at a time
// just before), so every byte is read from memory once: into_hashed=false copies
// hashed -> other (a put: hash the source), true copies other -> hashed (a get: hash
// what arrived, never the source again). Every byte of every run is copied, hashed or
// not; the bulk with streaming stores, fenced before this returns. `follow` (optional,
// `follow_len` bytes): what the caller reads next (the next object's first source run),
// prefetched as the last run ends.
uint64_t copy_checksum_runs(const int64_t* hashed, const int64_t* other, const int64_t* len, int64_t n,
                            bool into_hashed, const unsigned char* follow = nullptr, int64_t follow_len = 0);

}  // namespace kvxfer
