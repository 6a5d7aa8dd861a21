// XXH3-64 (seed 0, the default secret) over runs (see checksum.h). The total length is
// known up front, so this is the one-shot algorithm read through a cursor over the runs:
// inputs of up to 240 bytes are gathered and hashed by the short paths; longer ones are
// 64-byte stripes (a stripe that straddles two runs is gathered into a small buffer), a
// scramble after every 16 stripes, and the last 64 bytes as the final stripe. Whole
// blocks go through AVX2 where the CPU has it (checked once, at load), other stripes
// through SSE2 on x86-64; a scalar form serves other CPUs. All give the same bits.
// Copying while hashing (a same-host put or get), whole blocks that lie in one run are
// copied by the AVX2 loop itself: each vector is loaded once, stored to the other side
// and hashed, so the bytes hashed are the bytes written.
#include "checksum.h"

#include "copy.h"
#include "vm_copy.h"

#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvxfer {
namespace {

constexpr uint64_t P32_1 = 0x9E3779B1U, P32_2 = 0x85EBCA77U, P32_3 = 0xC2B2AE3DU;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL, P64_3 = 0x165667B19E3779F9ULL,
                   P64_4 = 0x85EBCA77C2B2AE63ULL, P64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t MX1 = 0x165667919E3779F9ULL, MX2 = 0x9FB21C651E98DF25ULL;
constexpr int64_t STRIPE = 64, STRIPES_PER_BLOCK = 16, SECRET_BYTES = 192;

// The algorithm's default secret (a constant of XXH3).
alignas(64) constexpr unsigned char SECRET[SECRET_BYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t load64(const unsigned char* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t load32(const unsigned char* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t fold(uint64_t a, uint64_t b) {
    const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
    return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33, h *= P64_2, h ^= h >> 29, h *= P64_3;
    return h ^ (h >> 32);
}

inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37, h *= MX1;
    return h ^ (h >> 32);
}

inline uint64_t mix16(const unsigned char* p, const unsigned char* s) {
    return fold(load64(p) ^ load64(s), load64(p + 8) ^ load64(s + 8));
}

// One-shot XXH3-64 of n <= 240 contiguous bytes, seed 0.
uint64_t hash_short(const unsigned char* p, uint64_t n) {
    const unsigned char* s = SECRET;
    if (n == 0) return xxh64_avalanche(load64(s + 56) ^ load64(s + 64));
    if (n <= 3) {
        const uint32_t combined = (static_cast<uint32_t>(p[0]) << 16) | (static_cast<uint32_t>(p[n >> 1]) << 24) |
                                  static_cast<uint32_t>(p[n - 1]) | static_cast<uint32_t>(n << 8);
        return xxh64_avalanche(combined ^ static_cast<uint64_t>(load32(s) ^ load32(s + 4)));
    }
    if (n <= 8) {
        const uint64_t in = static_cast<uint64_t>(load32(p + n - 4)) + (static_cast<uint64_t>(load32(p)) << 32);
        uint64_t h = in ^ (load64(s + 8) ^ load64(s + 16));
        h ^= rotl(h, 49) ^ rotl(h, 24), h *= MX2, h ^= (h >> 35) + n, h *= MX2;
        return h ^ (h >> 28);
    }
    if (n <= 16) {
        const uint64_t lo = load64(p) ^ (load64(s + 24) ^ load64(s + 32));
        const uint64_t hi = load64(p + n - 8) ^ (load64(s + 40) ^ load64(s + 48));
        return avalanche(n + __builtin_bswap64(lo) + hi + fold(lo, hi));
    }
    uint64_t acc = n * P64_1;
    if (n <= 128) {
        if (n > 32) {
            if (n > 64) {
                if (n > 96) acc += mix16(p + 48, s + 96) + mix16(p + n - 64, s + 112);
                acc += mix16(p + 32, s + 64) + mix16(p + n - 48, s + 80);
            }
            acc += mix16(p + 16, s + 32) + mix16(p + n - 32, s + 48);
        }
        acc += mix16(p, s) + mix16(p + n - 16, s + 16);
        return avalanche(acc);
    }
    for (int i = 0; i < 8; ++i) acc += mix16(p + 16 * i, s + 16 * i);
    acc = avalanche(acc);
    const int rounds = static_cast<int>(n / 16);
    for (int i = 8; i < rounds; ++i) acc += mix16(p + 16 * i, s + 16 * (i - 8) + 3);
    acc += mix16(p + n - 16, s + 136 - 17);
    return avalanche(acc);
}

// acc[8] += `stripes` consecutive 64-byte stripes at p, stripe k keyed by s + 8k.
void accumulate_scalar(uint64_t* acc, const unsigned char* p, const unsigned char* s, int64_t stripes) {
    for (int64_t k = 0; k < stripes; ++k, p += STRIPE, s += 8)
        for (int i = 0; i < 8; ++i) {
            const uint64_t v = load64(p + 8 * i), dk = v ^ load64(s + 8 * i);
            acc[i ^ 1] += v;
            acc[i] += (dk & 0xFFFFFFFFULL) * (dk >> 32);
        }
}

#if defined(__x86_64__)
// The same bits, two lanes a vector (SSE2 is in every x86-64): stripes outside whole
// blocks in place, and every block where the CPU lacks AVX2.
void accumulate_sse2(uint64_t* acc, const unsigned char* p, const unsigned char* s, int64_t stripes) {
    __m128i a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc) + j);
    for (int64_t k = 0; k < stripes; ++k, p += STRIPE, s += 8)
        for (int j = 0; j < 4; ++j) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + j);
            const __m128i dk = _mm_xor_si128(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s) + j));
            const __m128i prod = _mm_mul_epu32(dk, _mm_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1)));
            a[j] = _mm_add_epi64(a[j], _mm_add_epi64(prod, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2))));
        }
    for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc) + j, a[j]);
}

// Whole 1 KiB blocks (16 stripes, then a scramble, each), four lanes a vector and the
// accumulators in registers, where the CPU has AVX2 (the bulk of every large object).
// STORE copies each loaded vector to `dst` as it is hashed (the bytes hashed are the
// bytes written): 0 no copy, 1 ordinary stores, 2 streaming stores (dst 32-byte aligned).
// HASH=false: the same loads, stores and prefetches without the hash (a copy alone).
constexpr int64_t kPrefetchAhead = 16384;
template <int STORE, bool HASH = true>
__attribute__((target("avx2"))) void blocks_avx2(uint64_t* acc, const unsigned char* p, unsigned char* dst,
                                                 int64_t blocks, const unsigned char* next, int64_t next_len) {
    const __m256i prime = _mm256_set1_epi32(static_cast<int>(P32_1));
    const __m256i* key = reinterpret_cast<const __m256i*>(SECRET + SECRET_BYTES - STRIPE);
    __m256i a[2];
    for (int j = 0; j < 2; ++j) a[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + j);
    // Software prefetch 16 KiB ahead into every cache level (T0): the hardware prefetcher
    // alone leaves the loads waiting on memory (on an AMD EPYC host, 32 KiB runs copied
    // and hashed 1.2-1.3x faster with a prefetch). Not the non-temporal hint: on an Intel
    // Xeon (AMX, 2026-12-05) NTA lines were gone before their loads, and 32 MiB copied and
    // hashed at 5.5 GB/s against 13.6 with T0 4 KiB ahead (the memcpy limit there: 12.6
    // GB/s). On that host a put of 16 objects gathered from 32 KiB runs copied 1.1-1.15x
    // faster at 16 KiB than at 4 KiB (8 and 24 KiB between them). Past `end` the
    // prefetch goes on into `next` (the run read after these blocks; none: stop at `end`).
    const unsigned char* const end = p + blocks * STRIPE * STRIPES_PER_BLOCK;
    for (int64_t b = 0; b < blocks; ++b) {
        const unsigned char* s = SECRET;
        for (int k = 0; k < STRIPES_PER_BLOCK; ++k, p += STRIPE, dst += STRIPE, s += 8) {
            if (end - p > kPrefetchAhead)
                _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
            else if (kPrefetchAhead - (end - p) < next_len)
                _mm_prefetch(reinterpret_cast<const char*>(next + (kPrefetchAhead - (end - p))), _MM_HINT_T0);
            for (int j = 0; j < 2; ++j) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + j);
                if constexpr (STORE == 1) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + j, v);
                if constexpr (STORE == 2) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst) + j, v);
                if constexpr (!HASH) continue;
                const __m256i dk = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s) + j));
                const __m256i prod = _mm256_mul_epu32(dk, _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1)));
                a[j] = _mm256_add_epi64(a[j], _mm256_add_epi64(prod, _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2))));
            }
        }
        if constexpr (HASH) {
            for (int j = 0; j < 2; ++j) {  // acc = (acc ^ acc >> 47 ^ key) * PRIME32_1 (64-bit product)
                const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a[j], _mm256_srli_epi64(a[j], 47)),
                                                   _mm256_loadu_si256(key + j));
                const __m256i lo = _mm256_mul_epu32(x, prime);
                const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
                a[j] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
            }
        }
    }
    for (int j = 0; j < 2; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + j, a[j]);
}

// A static initializer runs before libgcc's CPU probe may have: probe first.
const bool HAS_AVX2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
}();
// Prefetch across run ends (see Cursor::fused_blocks) on AMD CPUs only: measured 1.3x
// faster on an AMD EPYC host, while on an Intel Xeon host (2026-12-05) prefetching on into
// the next run was 1.3x slower, so Intel keeps stopping at each run's end.
const bool PREFETCH_NEXT_RUN = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
}();
constexpr auto accumulate = accumulate_sse2;
#else
constexpr auto accumulate = accumulate_scalar;
#endif

void scramble(uint64_t* acc) {
    const unsigned char* s = SECRET + SECRET_BYTES - STRIPE;
    for (int i = 0; i < 8; ++i) {
        uint64_t a = acc[i];
        a ^= a >> 47, a ^= load64(s + 8 * i), a *= P32_1;
        acc[i] = a;
    }
}

// `blocks` whole 1 KiB blocks at p: 16 stripes, then a scramble, each.
void accumulate_blocks(uint64_t* acc, const unsigned char* p, int64_t blocks) {
#if defined(__x86_64__)
    if (HAS_AVX2) return blocks_avx2<0>(acc, p, nullptr, blocks, nullptr, 0);
#endif
    for (int64_t b = 0; b < blocks; ++b, p += STRIPE * STRIPES_PER_BLOCK) {
        accumulate(acc, p, SECRET, STRIPES_PER_BLOCK);
        scramble(acc);
    }
}

// A forward cursor over the runs: hands out the next `want` bytes as one pointer
// (in place when they lie in one run, else gathered into `buf`). With `other`, it
// also copies: each run's bytes between it and other[run], `into` saying which way
// (true: into the hashed runs), either whole blocks in the hashing loop itself
// (fused_blocks) or a chunk at a time just before it first hands them out (so they
// are hashed while in cache); finish() copies what was not handed out.
struct Cursor {
    const int64_t *addr, *len;
    int64_t n, run = 0, off = 0;
    const int64_t* other = nullptr;
    bool into = false;
    const unsigned char* follow = nullptr;  // with `other`: the bytes read after the last run (or none)
    int64_t follow_len = 0;
    int64_t copied = 0;  // with `other`: bytes of this run copied so far
    static constexpr int64_t kChunk = 64 << 10;

    unsigned char* at_run(const int64_t* base, int64_t k) const {
        return reinterpret_cast<unsigned char*>(static_cast<uintptr_t>(base[run])) + k;
    }
    void copy_next() {
        const int64_t step = len[run] - copied < kChunk ? len[run] - copied : kChunk;
        // out of the hashed runs (a put): streaming stores, as this process will not read
        // the other side; into them (a get): plain stores, so the hash reads them from cache
        if (into) std::memcpy(at_run(addr, copied), at_run(other, copied), step);
        else copy_bytes(reinterpret_cast<char*>(at_run(other, copied)),
                        reinterpret_cast<const char*>(at_run(addr, copied)), step, true);
        copied += step;
    }
    void next_run() { ++run, off = 0, copied = 0; }

    // With `other`, where nothing is copied ahead of the cursor: copy and hash up to `most`
    // whole 1 KiB hash blocks that lie in this run in one pass (each vector loaded once,
    // stored to the destination with streaming stores where it is aligned for them).
    // Returns the blocks done (0: not here or not on this CPU; the caller goes on as usual).
    int64_t fused_blocks(uint64_t* acc, int64_t most) {
#if defined(__x86_64__)
        if (other == nullptr || !HAS_AVX2) return 0;
        while (run < n && off == len[run]) next_run();
        if (run == n || off != copied) return 0;
        constexpr int64_t kBlock = STRIPE * STRIPES_PER_BLOCK;
        int64_t blocks = (len[run] - off) / kBlock;
        blocks = blocks < most ? blocks : most;
        if (blocks == 0) return 0;
        const int64_t* from = into ? other : addr;
        const unsigned char* src = at_run(from, off);
        unsigned char* dst = into ? at_run(addr, off) : at_run(other, off);
        // where these blocks end the run, the loop prefetches on into what is read next
        // (the next run, or after the last one the caller's `follow`): on an AMD EPYC host
        // (2026-12-05) 16 objects gathered from 32 KiB runs of 32 tensors copied and hashed
        // 1.3x faster (this loop alone: 0.86x -> 1.15x the memcpy limit), as the first 16 KiB
        // of each run no longer arrive unprefetched
        const unsigned char* next = nullptr;
        int64_t next_len = 0;
        if (PREFETCH_NEXT_RUN && off + blocks * kBlock == len[run]) {
            if (run + 1 < n) next = reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(from[run + 1])),
                             next_len = len[run + 1];
            else next = follow, next_len = follow_len;
        }
        if (reinterpret_cast<uintptr_t>(dst) % 32 == 0) blocks_avx2<2>(acc, src, dst, blocks, next, next_len);
        else blocks_avx2<1>(acc, src, dst, blocks, next, next_len);
        off += blocks * kBlock, copied = off;
        return blocks;
#else
        (void)acc, (void)most;
        return 0;
#endif
    }

    // The bytes that lie contiguously at the cursor (without moving it).
    int64_t contiguous(const unsigned char** at) {
        while (run < n && off == len[run]) next_run();
        if (run == n) return 0;
        *at = at_run(addr, off);
        if (other == nullptr) return len[run] - off;
        if (off == copied) copy_next();
        return copied - off;
    }
    void skip(int64_t k) {  // (with `other`: no further than contiguous() handed out)
        while (k > 0) {
            while (off == len[run]) next_run();
            const int64_t take = k < len[run] - off ? k : len[run] - off;
            off += take, k -= take;
        }
    }
    void finish() {
        if (other == nullptr) return;
        for (; run < n; next_run())
            while (copied < len[run]) copy_next();
    }
    const unsigned char* take(int64_t want, unsigned char* buf) {
        const unsigned char* at = nullptr;
        if (contiguous(&at) >= want) {
            off += want;
            return at;
        }
        for (int64_t got = 0; got < want;) {
            const int64_t k = contiguous(&at);
            const int64_t step = k < want - got ? k : want - got;
            std::memcpy(buf + got, at, step);
            off += step, got += step;
        }
        return buf;
    }
};

}  // namespace

namespace {

uint64_t hash_cursor(Cursor& cur, const int64_t* addr, const int64_t* len, int64_t n);

}  // namespace

uint64_t checksum_runs(const int64_t* addr, const int64_t* len, int64_t n) {
    Cursor cur{addr, len, n};
    return hash_cursor(cur, addr, len, n);
}

uint64_t copy_checksum_runs(const int64_t* hashed, const int64_t* other, const int64_t* len, int64_t n,
                            bool into_hashed, const unsigned char* follow, int64_t follow_len) {
    Cursor cur{hashed, len, n};
    cur.other = other;
    cur.into = into_hashed;
    cur.follow = follow, cur.follow_len = follow_len;
    const uint64_t h = hash_cursor(cur, hashed, len, n);
    cur.finish();
    fence(true);  // the streaming stores are visible before the caller commits or reads them
    return h;
}

namespace {

// One run copied as the copying hash copies it, without the hash: whole 1 KiB blocks
// through the same loop (its loads, streaming stores where dst is aligned for them, and
// prefetch, on into `next` where the blocks end the run, as Cursor::fused_blocks does),
// the rest by copy_bytes; fenced by the caller.
void copy_run(unsigned char* dst, const unsigned char* src, int64_t n, const unsigned char* next, int64_t next_len) {
    int64_t done = 0;
#if defined(__x86_64__)
    constexpr int64_t kBlock = STRIPE * STRIPES_PER_BLOCK;
    if (HAS_AVX2 && n >= kBlock) {
        const int64_t blocks = n / kBlock;
        if (!PREFETCH_NEXT_RUN || blocks * kBlock != n) next = nullptr, next_len = 0;
        uint64_t acc[8] = {};
        if (reinterpret_cast<uintptr_t>(dst) % 32 == 0) blocks_avx2<2, false>(acc, src, dst, blocks, next, next_len);
        else blocks_avx2<1, false>(acc, src, dst, blocks, next, next_len);
        done = blocks * kBlock;
    }
#else
    (void)next, (void)next_len;
#endif
    if (done < n)
        copy_bytes(reinterpret_cast<char*>(dst + done), reinterpret_cast<const char*>(src + done), n - done, true);
}

}  // namespace

void copy_checksum_objects(const int64_t* hashed, const int64_t* other, const int64_t* len, const int64_t* counts,
                           int64_t objects, bool into_hashed, int64_t split_bytes, uint64_t* out, bool hash) {
    std::vector<int64_t> first(objects + 1, 0);  // object i's runs: [first[i], first[i + 1])
    for (int64_t i = 0; i < objects; ++i) first[i + 1] = first[i] + counts[i];
    int64_t total = 0;
    for (int64_t r = 0; r < first[objects]; ++r) total += len[r];
    const int64_t* src = into_hashed ? other : hashed;
    auto one = [&](size_t i) {
        const int64_t at = first[i], k = counts[i];
        if (!hash) {  // the copies alone, in the same loop as the copying hash (copy_run)
            const int64_t* dst = into_hashed ? hashed : other;
            for (int64_t r = at; r < at + k; ++r) {
                if (len[r] == 0) continue;
                // what is read next: the next run, or the next object's first one
                const bool more = r + 1 < first[objects];
                copy_run(reinterpret_cast<unsigned char*>(static_cast<uintptr_t>(dst[r])),
                         reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(src[r])), len[r],
                         more ? reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(src[r + 1])) : nullptr,
                         more ? len[r + 1] : 0);
            }
            fence(true);
            out[i] = 0;
            return;
        }
        // the next object's first source run, prefetched as this one ends (on one thread
        // the next object is what comes next; on the pool, most often)
        const bool more = at + k < first[objects];
        out[i] = copy_checksum_runs(hashed + at, other + at, len + at, k, into_hashed,
                                    more ? reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(src[at + k]))
                                         : nullptr,
                                    more ? len[at + k] : 0);
    };
    // whole objects in turn: each is one checksum, so one thread's work
    if (split_bytes > 0 && total >= split_bytes && run_on_copy_pool(static_cast<size_t>(objects), one)) return;
    for (int64_t i = 0; i < objects; ++i) one(static_cast<size_t>(i));
}

namespace {

uint64_t hash_cursor(Cursor& cur, const int64_t* addr, const int64_t* len, int64_t n) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += len[i];
    alignas(64) unsigned char buf[240];
    if (total <= 240) return hash_short(cur.take(total, buf), static_cast<uint64_t>(total));

    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    const int64_t stripes = (total - 1) / STRIPE;  // the regular stripes; then the last 64 bytes
    for (int64_t k = 0; k < stripes;) {
        // from a block boundary: whole blocks copied and hashed in one pass where they lie
        // in one run (a copying cursor), else hashed in place where they lie contiguously
        const int64_t whole = k % STRIPES_PER_BLOCK == 0 ? (stripes - k) / STRIPES_PER_BLOCK : 0;
        if (whole > 0) {
            const int64_t fused = cur.fused_blocks(acc, whole);
            if (fused > 0) {
                k += fused * STRIPES_PER_BLOCK;
                continue;
            }
        }
        const unsigned char* at = nullptr;
        const int64_t here = cur.contiguous(&at) / STRIPE;
        if (whole > 0 && here >= STRIPES_PER_BLOCK) {
            const int64_t blocks = whole < here / STRIPES_PER_BLOCK ? whole : here / STRIPES_PER_BLOCK;
            accumulate_blocks(acc, at, blocks);
            cur.skip(blocks * STRIPES_PER_BLOCK * STRIPE);
            k += blocks * STRIPES_PER_BLOCK;
            continue;
        }
        // else as many stripes of this block as lie in place, in one call
        const int64_t in_block = STRIPES_PER_BLOCK - k % STRIPES_PER_BLOCK;
        int64_t batch = stripes - k < in_block ? stripes - k : in_block;
        const unsigned char* s = SECRET + 8 * (k % STRIPES_PER_BLOCK);
        if (here > 0) {
            batch = batch < here ? batch : here;
            accumulate(acc, at, s, batch);
            cur.skip(batch * STRIPE);
        } else {
            batch = 1;
            accumulate(acc, cur.take(STRIPE, buf), s, 1);
        }
        k += batch;
        if (k % STRIPES_PER_BLOCK == 0) scramble(acc);
    }
    cur.finish();  // a copying cursor: the bytes the last stripe reads are in place now
    // the last stripe is the input's last 64 bytes, which may overlap the stripes above
    alignas(64) unsigned char last[STRIPE];
    const int64_t consumed = stripes * STRIPE;
    const int64_t back = STRIPE - (total - consumed);  // bytes of the last stripe already consumed
    Cursor tail{addr, len, n};
    tail.skip(consumed - back);
    accumulate(acc, tail.take(STRIPE, last), SECRET + SECRET_BYTES - STRIPE - 7, 1);

    uint64_t h = static_cast<uint64_t>(total) * P64_1;
    for (int i = 0; i < 4; ++i) h += fold(acc[2 * i] ^ load64(SECRET + 11 + 16 * i), acc[2 * i + 1] ^ load64(SECRET + 11 + 16 * i + 8));
    return avalanche(h);
}

}  // namespace

}  // namespace kvxfer
