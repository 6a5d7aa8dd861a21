// XXH64, streaming over runs (see checksum.h): four 8-byte lanes per 32-byte stripe, a
// stripe that straddles two runs goes through a small buffer.
#include "checksum.h"

#include <cstring>

namespace kvxfer {
namespace {

constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL, P3 = 1609587929392839161ULL,
                   P4 = 9650029242287828579ULL, P5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round1(0, v)) * P1 + P4; }
inline uint64_t load64(const unsigned char* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t load32(const unsigned char* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

struct State {
    uint64_t v[4] = {P1 + P2, P2, 0, 0 - P1};
    unsigned char buf[32];
    int64_t buffered = 0, total = 0;

    void stripe(const unsigned char* p) {
        v[0] = round1(v[0], load64(p));
        v[1] = round1(v[1], load64(p + 8));
        v[2] = round1(v[2], load64(p + 16));
        v[3] = round1(v[3], load64(p + 24));
    }

    void update(const unsigned char* p, int64_t n) {
        total += n;
        if (buffered) {
            int64_t take = n < 32 - buffered ? n : 32 - buffered;
            std::memcpy(buf + buffered, p, take);
            buffered += take, p += take, n -= take;
            if (buffered < 32) return;
            stripe(buf);
            buffered = 0;
        }
        for (; n >= 32; p += 32, n -= 32) stripe(p);
        std::memcpy(buf, p, n);
        buffered = n;
    }

    uint64_t digest() const {
        uint64_t h = total >= 32 ? rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18) : P5;
        if (total >= 32)
            for (uint64_t lane : v) h = merge(h, lane);
        h += static_cast<uint64_t>(total);
        const unsigned char* p = buf;
        int64_t n = buffered;
        for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round1(0, load64(p)), 27) * P1 + P4;
        if (n >= 4) h = rotl(h ^ (static_cast<uint64_t>(load32(p)) * P1), 23) * P2 + P3, p += 4, n -= 4;
        for (; n > 0; ++p, --n) h = rotl(h ^ (*p * P5), 11) * P1;
        h ^= h >> 33, h *= P2, h ^= h >> 29, h *= P3, h ^= h >> 32;
        return h;
    }
};

}  // namespace

uint64_t checksum_runs(const int64_t* addr, const int64_t* len, int64_t n) {
    State s;
    for (int64_t i = 0; i < n; ++i)
        s.update(reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(addr[i])), len[i]);
    return s.digest();
}

}  // namespace kvxfer
