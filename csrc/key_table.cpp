// The store node's published key set (key_table.h).
#include "key_table.h"

#include <atomic>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include "checksum.h"

namespace kvxfer {
namespace {

constexpr uint64_t kMagic = 0x324c42544b58564bULL;  // "KVXKTBL2"

struct Header {
    uint64_t magic;
    uint64_t nbuckets;
    std::atomic<int64_t> heartbeat_ns;  // 0: the writer stopped
    uint8_t pad[40];
};
static_assert(sizeof(Header) == 64, "the header is one cache line");

struct alignas(64) Bucket {
    std::atomic<uint64_t> fp[kKeyTableWays];  // 0: a free way
    std::atomic<uint32_t> overflow;           // keys of this bucket that found it full
    uint32_t pad;
};
static_assert(sizeof(Bucket) == 64, "a bucket is one cache line");
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "readers in other processes need lock-free words");

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void check_geometry(uintptr_t base, uint64_t nbuckets) {
    if (base == 0) throw std::invalid_argument("key table: null base");
    if (nbuckets == 0 || (nbuckets & (nbuckets - 1)) != 0)
        throw std::invalid_argument("key table: nbuckets must be a power of two");
}

void check_key(size_t len) {
    if (len == 0 || len > kKeyTableMaxKey) throw std::invalid_argument("key table: a key is 1..64 bytes");
}

Header* header(uintptr_t base) { return reinterpret_cast<Header*>(base); }

uint64_t hash_of(const uint8_t* key, size_t len) {
    const int64_t addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(key));
    const int64_t n = static_cast<int64_t>(len);
    return checksum_runs(&addr, &n, 1);
}

// The bucket and fingerprint of the key of hash h.
std::pair<Bucket*, uint64_t> locate_hashed(uintptr_t base, uint64_t nbuckets, uint64_t h) {
    return {reinterpret_cast<Bucket*>(base + sizeof(Header)) + (h & (nbuckets - 1)), h == 0 ? 1 : h};
}

std::pair<Bucket*, uint64_t> locate(uintptr_t base, uint64_t nbuckets, const uint8_t* key, size_t len) {
    return locate_hashed(base, nbuckets, hash_of(key, len));
}

uint8_t probe(const Bucket* b, uint64_t fp) {
    uint8_t code = b->overflow.load(std::memory_order_acquire) > 0 ? 2 : 0;
    for (uint32_t w = 0; w < kKeyTableWays; ++w)
        if (b->fp[w].load(std::memory_order_acquire) == fp) code = 1;
    return code;
}

}  // namespace

size_t key_table_bytes(uint64_t nbuckets) {
    if (nbuckets == 0 || (nbuckets & (nbuckets - 1)) != 0 || nbuckets > (uint64_t(1) << 34))
        throw std::invalid_argument("key table: nbuckets must be a power of two up to 2^34");
    return sizeof(Header) + nbuckets * sizeof(Bucket);
}

void key_table_init(uintptr_t base, uint64_t nbuckets) {
    check_geometry(base, nbuckets);
    std::memset(reinterpret_cast<void*>(base), 0, key_table_bytes(nbuckets));
    Header* h = header(base);
    h->magic = kMagic;
    h->nbuckets = nbuckets;
    h->heartbeat_ns.store(now_ns(), std::memory_order_release);
}

bool key_table_add(uintptr_t base, uint64_t nbuckets, const uint8_t* key, size_t len) {
    check_geometry(base, nbuckets);
    check_key(len);
    auto [b, fp] = locate(base, nbuckets, key, len);
    for (uint32_t w = 0; w < kKeyTableWays; ++w) {
        if (b->fp[w].load(std::memory_order_relaxed) != 0) continue;
        b->fp[w].store(fp, std::memory_order_release);
        return true;
    }
    b->overflow.fetch_add(1, std::memory_order_release);
    return false;
}

void key_table_remove(uintptr_t base, uint64_t nbuckets, const uint8_t* key, size_t len) {
    check_geometry(base, nbuckets);
    check_key(len);
    auto [b, fp] = locate(base, nbuckets, key, len);
    // Fingerprints stand for keys: a way of this fingerprint is this key's (or, for
    // keys that share a fingerprint, as good as it); with none, the key overflowed.
    for (uint32_t w = 0; w < kKeyTableWays; ++w) {
        if (b->fp[w].load(std::memory_order_relaxed) == fp) {
            b->fp[w].store(0, std::memory_order_release);
            return;
        }
    }
    if (b->overflow.load(std::memory_order_relaxed) > 0) b->overflow.fetch_sub(1, std::memory_order_release);
}

void key_table_beat(uintptr_t base, bool alive) {
    if (base == 0) throw std::invalid_argument("key table: null base");
    header(base)->heartbeat_ns.store(alive ? now_ns() : 0, std::memory_order_release);
}

int64_t key_table_age_ns(uintptr_t base, uint64_t nbuckets) {
    check_geometry(base, nbuckets);
    const Header* h = header(base);
    if (h->magic != kMagic || h->nbuckets != nbuckets) return -1;
    const int64_t beat = h->heartbeat_ns.load(std::memory_order_acquire);
    if (beat <= 0) return -1;
    const int64_t age = now_ns() - beat;
    return age < 0 ? 0 : age;
}

void key_table_find(uintptr_t base, uint64_t nbuckets, const uint8_t* const* keys, const size_t* lens, size_t n,
                    uint8_t* out) {
    check_geometry(base, nbuckets);
    for (size_t i = 0; i < n; ++i) check_key(lens[i]);
    for (size_t i = 0; i < n; ++i) {
        auto [b, fp] = locate(base, nbuckets, keys[i], lens[i]);
        out[i] = probe(b, fp);
    }
}

uint64_t key_table_hash(const uint8_t* key, size_t len) {
    check_key(len);
    return hash_of(key, len);
}

void key_table_find_hashed(uintptr_t base, uint64_t nbuckets, const uint64_t* hashes, size_t n, uint8_t* out) {
    check_geometry(base, nbuckets);
    for (size_t i = 0; i < n; ++i) {
        auto [b, fp] = locate_hashed(base, nbuckets, hashes[i]);
        out[i] = probe(b, fp);
    }
}

}  // namespace kvxfer
