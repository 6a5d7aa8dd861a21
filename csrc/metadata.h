// The bytes one engine gives its peers (after the agent authenticated them):
// identity for same-host detection, the UCX worker address, the vm probe area,
// and every region (id, addr, length, packed rkey, shared-memory reference).
//
// Layout (little-endian): "KVXM" u16 version, then the fields of PeerInfo in
// order, each string as u32 length + bytes, then an FNV-1a 64 checksum of all
// preceding bytes. Parsing checks every length against the bytes left and the
// checksum before anything reaches UCX, so truncated or corrupted metadata
// raises ProtocolError instead of crashing inside ucp_ep_create.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "shared_mem.h"

namespace kvxfer {

struct RegionAd {
    uint64_t id = 0;
    uint64_t addr = 0;
    uint64_t length = 0;
    uint32_t kind = 0;  // MemKind: 0 host, 1 cuda
    std::string rkey;
    ShmRef shm;  // host memory in kvxfer shared allocations (shared_mem.h); no pieces otherwise
};

struct PeerInfo {
    uint64_t uid = 0;      // random per engine
    uint32_t pid = 0;
    std::string hostname;
    std::string boot_id;   // /proc/sys/kernel/random/boot_id
    uint64_t pid_ns = 0;   // inode of /proc/self/ns/pid
    uint64_t probe_addr = 0;  // token[16] then scratch bytes, see vm_copy.h
    uint64_t probe_length = 0;
    std::string probe_token;
    std::string worker_address;
    std::vector<RegionAd> regions;
};

std::string encode_metadata(const PeerInfo& info);
PeerInfo decode_metadata(const std::string& bytes);  // throws ProtocolError

// This process's identity fields (hostname, boot id, pid namespace, pid).
void fill_host_identity(PeerInfo& info);
bool same_host(const PeerInfo& a, const PeerInfo& b);

}  // namespace kvxfer
