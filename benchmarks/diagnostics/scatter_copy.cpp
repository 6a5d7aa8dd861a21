// The ceiling of a scattered KV copy on this machine: 8,192 runs of 32 KiB (one per
// layer, K/V and block of Llama-3-8B at 2,048 tokens) copied between random slots of
// two huge-page buffers on 2 threads, vs the same bytes copied contiguously; glibc
// memcpy, SSE2 and AVX-512 streaming stores, SSE2 with software prefetch. Native code
// only, no kvxfer (docs/benchmarks.md, End to end):
//
//   g++ -O3 -march=native -pthread benchmarks/diagnostics/scatter_copy.cpp -o /tmp/scatter_copy && /tmp/scatter_copy
#include <immintrin.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <algorithm>
using namespace std;
static void sse(char* d, const char* s, size_t n) {
  for (size_t k = 0; k < n; k += 64) {
    __m128i a=_mm_loadu_si128((const __m128i*)(s+k)),b=_mm_loadu_si128((const __m128i*)(s+k+16)),c=_mm_loadu_si128((const __m128i*)(s+k+32)),e=_mm_loadu_si128((const __m128i*)(s+k+48));
    _mm_stream_si128((__m128i*)(d+k),a);_mm_stream_si128((__m128i*)(d+k+16),b);_mm_stream_si128((__m128i*)(d+k+32),c);_mm_stream_si128((__m128i*)(d+k+48),e);}
}
__attribute__((target("avx512f"))) static void avx(char* d, const char* s, size_t n) {
  for (size_t k = 0; k < n; k += 128) {
    __m512i a=_mm512_loadu_si512(s+k), b=_mm512_loadu_si512(s+k+64);
    _mm512_stream_si512((__m512i*)(d+k),a); _mm512_stream_si512((__m512i*)(d+k+64),b);}
}
static void ssepf(char* d, const char* s, size_t n) {
  for (size_t k = 0; k < n; k += 64) {
    _mm_prefetch(s+k+1024, _MM_HINT_T0);
    __m128i a=_mm_loadu_si128((const __m128i*)(s+k)),b=_mm_loadu_si128((const __m128i*)(s+k+16)),c=_mm_loadu_si128((const __m128i*)(s+k+32)),e=_mm_loadu_si128((const __m128i*)(s+k+48));
    _mm_stream_si128((__m128i*)(d+k),a);_mm_stream_si128((__m128i*)(d+k+16),b);_mm_stream_si128((__m128i*)(d+k+32),c);_mm_stream_si128((__m128i*)(d+k+48),e);}
}
static void lib(char* d, const char* s, size_t n) { memcpy(d, s, n); }
int main() {
  const size_t RUN = 32 << 10, NB = 11264, POOL = NB * RUN, N = 8192;
  char* S = (char*)mmap(0, POOL, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  char* D = (char*)mmap(0, POOL, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  madvise(S, POOL, MADV_HUGEPAGE); madvise(D, POOL, MADV_HUGEPAGE); memset(S, 1, POOL); memset(D, 2, POOL);
  vector<size_t> si(NB), di(NB); for (size_t i=0;i<NB;i++) si[i]=di[i]=i;
  mt19937 g(1); shuffle(si.begin(), si.end(), g); shuffle(di.begin(), di.end(), g);
  struct V { const char* name; void (*f)(char*, const char*, size_t); };
  V vs[] = {{"libc", lib}, {"sse-nt", sse}, {"avx512-nt", avx}, {"sse-nt-pf", ssepf}};
  for (int rep = 0; rep < 2; rep++) for (auto& v : vs) for (int mode = 0; mode < 2; mode++) {
    double best = 1e9;
    for (int it = 0; it < 5; it++) {
      auto t0 = chrono::steady_clock::now();
      auto work = [&](size_t lo, size_t hi) {
        if (mode == 0) v.f(D + lo * RUN, S + lo * RUN, (hi - lo) * RUN);
        else for (size_t i = lo; i < hi; i++) v.f(D + di[i] * RUN, S + si[i] * RUN, RUN);
        _mm_sfence(); };
      thread t(work, N / 2, N); work(0, N / 2); t.join();
      best = min(best, chrono::duration<double>(chrono::steady_clock::now() - t0).count());
    }
    printf("%-10s %-10s %.1f GB/s\n", v.name, mode ? "scattered" : "contig", N * RUN / best / 1e9);
  }
}
