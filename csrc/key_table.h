// A store node's published key set: fingerprints of the keys it holds committed, as a
// bucketed hash set in memory that same-host clients map (a kvxfer.shared_empty
// region, mapped on the vm path; shared_mem.h), so a lookup there reads the set
// instead of asking the node.
//
// A key's 64-bit XXH3 picks its bucket (the low bits) and is its fingerprint (0 is
// stored as 1; 0 marks a free way). A bucket is one cache line: kKeyTableWays
// fingerprints and an overflow count. One writer (the node's I/O thread) and readers
// in any number of processes: every field is one aligned 64- or 32-bit word, written
// and read atomically, so a reader sees each way either before or after a change and
// a lookup needs no lock or retry. A key that finds its bucket full is not written but
// counted in the overflow, and a reader that misses a key in a bucket with overflow
// answers "unknown" (the caller asks the node). Two keys of one fingerprint each take
// a way (the writer adds and removes each key once), so a collision can only make a
// lookup say present for a key that is not (the get then misses at the node; the
// odds are the fingerprint's 2^-64 per way). The header carries a heartbeat
// (CLOCK_MONOTONIC ns) the writer refreshes, so a reader can tell a table whose node
// stopped.
//
// Readers take the geometry (nbuckets) from the node's authenticated INFO, never from
// the shared memory, and every read is bounded by it: a table scribbled on by anyone
// who can write the region gives wrong answers (a lookup is advice; gets check at the
// node), never a read outside it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvxfer {

constexpr uint32_t kKeyTableWays = 7;
constexpr uint32_t kKeyTableMaxKey = 64;

// Bytes of a table of `nbuckets` buckets (a power of two >= 1), header included.
size_t key_table_bytes(uint64_t nbuckets);
// Writer side (the table at `base`, key_table_bytes(nbuckets) bytes, owned by the caller).
void key_table_init(uintptr_t base, uint64_t nbuckets);
bool key_table_add(uintptr_t base, uint64_t nbuckets, const uint8_t* key, size_t len);  // false: overflowed
void key_table_remove(uintptr_t base, uint64_t nbuckets, const uint8_t* key, size_t len);
void key_table_beat(uintptr_t base, bool alive);  // alive=false: the writer stopped (readers see it at once)
// Reader side: nanoseconds since the last heartbeat (-1: the writer stopped or the
// header is not a table of `nbuckets`).
int64_t key_table_age_ns(uintptr_t base, uint64_t nbuckets);
// out[i] = 1 present, 0 absent, 2 unknown (its bucket overflowed).
void key_table_find(uintptr_t base, uint64_t nbuckets, const uint8_t* const* keys, const size_t* lens,
                    size_t n, uint8_t* out);
// A key's 64-bit hash (XXH3-64: its bucket and fingerprint); throws for a key not 1..64 bytes.
uint64_t key_table_hash(const uint8_t* key, size_t len);
// key_table_find by the keys' key_table_hash values (what a peer sends: remote_lookup.cpp).
void key_table_find_hashed(uintptr_t base, uint64_t nbuckets, const uint64_t* hashes, size_t n, uint8_t* out);

}  // namespace kvxfer
