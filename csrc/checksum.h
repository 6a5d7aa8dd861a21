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

// copy_checksum_runs of `objects` objects, object i being counts[i] consecutive runs of
// hashed/other/len; out[i] its checksum. Where the objects hold at least split_bytes in
// all (0: never), the calling thread and the process's copy pool (vm_copy.h) take whole
// objects in turn: one thread copying and hashing is bound by its own work, not by memory
// (AMD EPYC host, 2026-12-05, caches flushed: 256 MiB gathered from 32 KiB runs copied
// and hashed 1.4x faster on two threads than on one as a put, 1.8x as a get).
// hash=false: the same copies in the same loop on the same threads without the hash
// (out[i] = 0): a store client without checksums.
void copy_checksum_objects(const int64_t* hashed, const int64_t* other, const int64_t* len, const int64_t* counts,
                           int64_t objects, bool into_hashed, int64_t split_bytes, uint64_t* out, bool hash = true);

}  // namespace kvxfer
