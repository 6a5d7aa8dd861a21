#include "metadata.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "errors.h"

namespace kvxfer {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'X', 'M'};
constexpr uint16_t kVersion = 2;
constexpr uint32_t kMaxString = 1u << 20;
constexpr uint32_t kMaxRegions = 1u << 20;

uint64_t fnv1a(const char* p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) {
        h ^= static_cast<unsigned char>(p[i]);
        h *= 1099511628211ull;
    }
    return h;
}

struct Writer {
    std::string out;
    template <class T>
    void pod(T v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
    void str(const std::string& s) {
        pod<uint32_t>(static_cast<uint32_t>(s.size()));
        out.append(s);
    }
};

struct Reader {
    const char* p;
    size_t left;
    void need(size_t n) {
        if (n > left) throw ProtocolError("peer metadata is truncated");
    }
    template <class T>
    T pod() {
        need(sizeof(T));
        T v;
        std::memcpy(&v, p, sizeof(T));
        p += sizeof(T);
        left -= sizeof(T);
        return v;
    }
    std::string str() {
        uint32_t n = pod<uint32_t>();
        if (n > kMaxString) throw ProtocolError("peer metadata: string field too long");
        need(n);
        std::string s(p, n);
        p += n;
        left -= n;
        return s;
    }
};

std::string read_first_line(const char* path) {
    std::ifstream f(path);
    std::string line;
    if (f) std::getline(f, line);
    return line;
}

}  // namespace

std::string encode_metadata(const PeerInfo& info) {
    Writer w;
    w.out.append(kMagic, 4);
    w.pod<uint16_t>(kVersion);
    w.pod<uint64_t>(info.uid);
    w.pod<uint32_t>(info.pid);
    w.str(info.hostname);
    w.str(info.boot_id);
    w.pod<uint64_t>(info.pid_ns);
    w.pod<uint64_t>(info.probe_addr);
    w.pod<uint64_t>(info.probe_length);
    w.str(info.probe_token);
    w.str(info.worker_address);
    w.pod<uint32_t>(static_cast<uint32_t>(info.regions.size()));
    for (const auto& r : info.regions) {
        w.pod<uint64_t>(r.id);
        w.pod<uint64_t>(r.addr);
        w.pod<uint64_t>(r.length);
        w.pod<uint32_t>(r.kind);
        w.str(r.rkey);
        w.pod<uint64_t>(r.shm.offset);
        w.pod<uint32_t>(static_cast<uint32_t>(r.shm.pieces.size()));
        for (const ShmPiece& p : r.shm.pieces) {
            w.pod<int32_t>(p.fd);
            w.pod<uint64_t>(p.ino);
            w.pod<uint64_t>(p.size);
        }
    }
    w.pod<uint64_t>(fnv1a(w.out.data(), w.out.size()));
    return w.out;
}

PeerInfo decode_metadata(const std::string& bytes) {
    if (bytes.size() < 4 + 2 + 8 || std::memcmp(bytes.data(), kMagic, 4) != 0)
        throw ProtocolError("not kvxfer backend metadata (bad magic)");
    const size_t body = bytes.size() - 8;
    uint64_t sum;
    std::memcpy(&sum, bytes.data() + body, 8);
    if (sum != fnv1a(bytes.data(), body)) throw ProtocolError("peer metadata checksum mismatch");

    Reader r{bytes.data() + 4, body - 4};
    if (r.pod<uint16_t>() != kVersion) throw ProtocolError("unsupported peer metadata version");
    PeerInfo info;
    info.uid = r.pod<uint64_t>();
    info.pid = r.pod<uint32_t>();
    info.hostname = r.str();
    info.boot_id = r.str();
    info.pid_ns = r.pod<uint64_t>();
    info.probe_addr = r.pod<uint64_t>();
    info.probe_length = r.pod<uint64_t>();
    info.probe_token = r.str();
    info.worker_address = r.str();
    if (info.worker_address.empty()) throw ProtocolError("peer metadata: empty worker address");
    uint32_t n = r.pod<uint32_t>();
    if (n > kMaxRegions) throw ProtocolError("peer metadata: too many regions");
    for (uint32_t i = 0; i < n; ++i) {
        RegionAd ad;
        ad.id = r.pod<uint64_t>();
        ad.addr = r.pod<uint64_t>();
        ad.length = r.pod<uint64_t>();
        ad.kind = r.pod<uint32_t>();
        ad.rkey = r.str();
        ad.shm.offset = r.pod<uint64_t>();
        const uint32_t pieces = r.pod<uint32_t>();
        if (pieces > kMaxShmPieces) throw ProtocolError("peer metadata: too many shared-memory pieces");
        uint64_t shm_bytes = 0;
        bool shm_ok = true;
        for (uint32_t k = 0; k < pieces; ++k) {
            ShmPiece p;
            p.fd = r.pod<int32_t>();
            p.ino = r.pod<uint64_t>();
            p.size = r.pod<uint64_t>();
            shm_ok = shm_ok && p.fd >= 0 && p.size > 0 && shm_bytes + p.size > shm_bytes;
            shm_bytes += p.size;
            ad.shm.pieces.push_back(p);
        }
        if (pieces > 0 && (ad.kind != 0 || ad.shm.offset > shm_bytes || ad.length > shm_bytes - ad.shm.offset))
            shm_ok = false;
        if (ad.length == 0 || ad.kind > 1 || ad.addr + ad.length < ad.addr || ad.rkey.empty() || !shm_ok)
            throw ProtocolError("peer metadata: malformed region " + std::to_string(ad.id));
        info.regions.push_back(std::move(ad));
    }
    if (r.left != 0) throw ProtocolError("peer metadata: trailing bytes");
    return info;
}

void fill_host_identity(PeerInfo& info) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    info.hostname = host;
    info.boot_id = read_first_line("/proc/sys/kernel/random/boot_id");
    struct stat st;
    info.pid_ns = stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
    info.pid = static_cast<uint32_t>(getpid());
}

bool same_host(const PeerInfo& a, const PeerInfo& b) {
    return !a.boot_id.empty() && a.boot_id == b.boot_id && a.hostname == b.hostname &&
           a.pid_ns != 0 && a.pid_ns == b.pid_ns;
}

}  // namespace kvxfer
