#include "shared_mem.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

#include "errors.h"

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif

namespace kvxfer {
namespace {

struct Allocation {
    uintptr_t addr;
    size_t length;
    int fd;
    uint64_t ino;
};

std::mutex g_mu;
std::vector<Allocation> g_allocs;  // few and long-lived (one per pool)

size_t page_size() {
    static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return p;
}

constexpr size_t kHugePage = size_t{2} << 20;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Allocates every page now (after the huge-page hint), so no copy ever faults.
void populate(void* p, size_t length) {
    if (madvise(p, length, MADV_POPULATE_WRITE) == 0) return;  // Linux >= 5.14
    volatile char* c = static_cast<volatile char*>(p);
    for (size_t at = 0; at < length; at += page_size()) c[at] = 0;
}

int make_memfd(size_t length) {
    int fd = static_cast<int>(syscall(SYS_memfd_create, "kvxfer-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (fd < 0) throw RegistrationError(std::string("memfd_create: ") + std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(length)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        const int err = errno;
        close(fd);
        throw RegistrationError(std::string("shared memory of ") + std::to_string(length) +
                                " bytes: " + std::strerror(err));
    }
    return fd;
}

}  // namespace

uintptr_t shared_alloc(size_t length) {
    if (length == 0) throw RegistrationError("shared memory: zero length");
    // From 2 MiB on, whole huge pages: where the kernel gives shared memory transparent
    // huge pages (shmem_enabled = advise or always), both sides map them with few TLB entries.
    const size_t unit = length >= kHugePage ? kHugePage : page_size();
    const size_t rounded = (length + unit - 1) / unit * unit;
    const int fd = make_memfd(rounded);
    struct stat st;
    void* p = fstat(fd, &st) == 0 ? mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED) {
        const int err = errno;
        close(fd);
        throw RegistrationError(std::string("mmap of shared memory: ") + std::strerror(err));
    }
    if (unit == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // a hint: ignored where unsupported
    populate(p, rounded);
    std::lock_guard<std::mutex> g(g_mu);
    g_allocs.push_back({reinterpret_cast<uintptr_t>(p), rounded, fd, static_cast<uint64_t>(st.st_ino)});
    return reinterpret_cast<uintptr_t>(p);
}

bool shared_free(uintptr_t addr) {
    std::lock_guard<std::mutex> g(g_mu);
    for (size_t i = 0; i < g_allocs.size(); ++i) {
        if (g_allocs[i].addr != addr) continue;
        munmap(reinterpret_cast<void*>(addr), g_allocs[i].length);
        close(g_allocs[i].fd);
        g_allocs.erase(g_allocs.begin() + static_cast<long>(i));
        return true;
    }
    return false;
}

ShmRef shared_lookup(uintptr_t addr, size_t length) {
    ShmRef out;
    if (length == 0) return out;
    std::lock_guard<std::mutex> g(g_mu);
    uintptr_t at = addr;
    const uintptr_t end = addr + length;
    while (at < end && out.pieces.size() < kMaxShmPieces) {
        const Allocation* hit = nullptr;
        for (const Allocation& a : g_allocs)
            if (at >= a.addr && at - a.addr < a.length) hit = &a;
        // The first piece may start anywhere in its allocation, the next ones at their start.
        if (!hit || (!out.pieces.empty() && hit->addr != at)) return {};
        if (out.pieces.empty()) out.offset = at - hit->addr;
        out.pieces.push_back({hit->fd, hit->ino, hit->length});
        at = hit->addr + hit->length;
    }
    return at >= end ? out : ShmRef{};
}

PeerSegments::~PeerSegments() {
    for (const auto& m : maps_) munmap(m.first, m.second);
}

namespace {

// Maps process pid's memfd `piece` at `where` (inside a reservation); false if it does not check out.
bool map_piece(pid_t pid, const ShmPiece& piece, void* where) {
    if (piece.fd < 0 || piece.size == 0 || piece.size % page_size()) return false;
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(piece.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat st;
    const int seals = fcntl(fd, F_GET_SEALS);  // fails (EINVAL) on anything but a memfd
    bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_ino) == piece.ino &&
              static_cast<uint64_t>(st.st_size) == piece.size && seals >= 0 && (seals & F_SEAL_SHRINK);
    ok = ok && mmap(where, piece.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) == where;
    close(fd);
    return ok;
}

}  // namespace

uintptr_t PeerSegments::map(pid_t pid, const ShmRef& ref, uint64_t length) {
    if (ref.pieces.empty() || ref.pieces.size() > kMaxShmPieces || pid <= 0) return 0;
    uint64_t total = 0;
    for (const ShmPiece& p : ref.pieces) {
        if (p.size > (uint64_t{1} << 48) || total + p.size < total) return 0;
        total += p.size;
    }
    if (ref.offset > total || length > total - ref.offset) return 0;
    // One reservation (2 MiB aligned, so huge pages map as such), then each memfd over
    // its part of it: the range is contiguous here too.
    void* raw = mmap(nullptr, total + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return 0;
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (r + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > r) munmap(raw, aligned - r);
    if (r + kHugePage > aligned) munmap(reinterpret_cast<void*>(aligned + total), r + kHugePage - aligned);
    void* base = reinterpret_cast<void*>(aligned);
    uint64_t at = 0;
    for (const ShmPiece& p : ref.pieces) {
        if (!map_piece(pid, p, static_cast<char*>(base) + at)) {
            munmap(base, total);
            return 0;
        }
        at += p.size;
    }
    maps_.emplace_back(base, static_cast<size_t>(total));
    return reinterpret_cast<uintptr_t>(base) + ref.offset;
}

}  // namespace kvxfer
