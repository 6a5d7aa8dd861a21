// Multi-threaded gather/scatter of KV tiles (see copy.h). Each thread takes a
// contiguous range of (plane, block) tiles, so its wire bytes are contiguous too.
#include "copy.h"

#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvxfer {

// memcpy, or, for copies far larger than the caches, non-temporal stores: libc uses
// them only for one huge memcpy, so a gather of 32 KiB tiles would otherwise pay a
// read-for-ownership of every destination line (1.5x the memory traffic).
void copy_bytes(char* dst, const char* src, int64_t n, bool streaming) {
#if defined(__SSE2__)
    if (streaming && n >= 256) {
        const int64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
        std::memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        const int64_t body = n & ~int64_t(63);
        for (int64_t k = 0; k < body; k += 64) {
            __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
            __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
            __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
            __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
        }
        std::memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    std::memcpy(dst, src, n);
}

void fence(bool streaming) {
#if defined(__SSE2__)
    if (streaming) _mm_sfence();  // order the streaming stores before the caller sees "done"
#endif
}

namespace {

void copy_range(const TileCopy& j, bool to_wire, int64_t first, int64_t last) {
    const bool st = j.streaming;
    char* wire = reinterpret_cast<char*>(j.wire);
    const bool whole = j.row_bytes == j.tile_bytes;
    for (int64_t t = first; t < last; ++t) {
        const int64_t p = t / j.num_ids, i = t % j.num_ids;
        char* eng = reinterpret_cast<char*>(j.plane_addr[p] + j.ids[i] * j.block_stride[p]);
        char* w = wire + t * j.tile_bytes;
        if (whole) {
            // Extend over following tiles that are adjacent on both sides (consecutive ids).
            int64_t n = 1;
            while (t + n < last && (t + n) / j.num_ids == p &&
                   j.ids[i + n] * j.block_stride[p] == j.ids[i] * j.block_stride[p] + n * j.tile_bytes)
                ++n;
            if (to_wire) copy_bytes(w, eng, n * j.tile_bytes, st);
            else copy_bytes(eng, w, n * j.tile_bytes, st);
            t += n - 1;
            continue;
        }
        const int64_t* os = j.outer_stride + 3 * p;
        for (int64_t a = 0; a < j.sizes[0]; ++a)
            for (int64_t b = 0; b < j.sizes[1]; ++b)
                for (int64_t c = 0; c < j.sizes[2]; ++c) {
                    char* e = eng + a * os[0] + b * os[1] + c * os[2];
                    if (to_wire) copy_bytes(w, e, j.row_bytes, st);
                    else copy_bytes(e, w, j.row_bytes, st);
                    w += j.row_bytes;
                }
    }
    fence(st);
}

}  // namespace

void copy_tiles(const TileCopy& job, bool to_wire, int num_threads) {
    const int64_t total = job.num_planes * job.num_ids;
    if (total == 0) return;
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    if (threads > total) threads = total;
    if (threads == 1) {
        copy_range(job, to_wire, 0, total);
        return;
    }
    std::vector<std::thread> pool;
    for (int64_t k = 1; k < threads; ++k)
        pool.emplace_back(copy_range, std::cref(job), to_wire, total * k / threads, total * (k + 1) / threads);
    copy_range(job, to_wire, 0, total / threads);
    for (auto& th : pool) th.join();
}

void memcpy_parallel(uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads) {
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    auto part = [=](int64_t k) {
        const int64_t lo = nbytes * k / threads, hi = nbytes * (k + 1) / threads;
        std::memcpy(reinterpret_cast<char*>(dst) + lo, reinterpret_cast<const char*>(src) + lo, hi - lo);
    };
    std::vector<std::thread> pool;
    for (int64_t k = 1; k < threads; ++k) pool.emplace_back(part, k);
    part(0);
    for (auto& th : pool) th.join();
}

}  // namespace kvxfer
