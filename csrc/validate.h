// Descriptor validation and coalescing, done in full before anything is posted.
//
// A batch is int64 [n, 5]: (local_region, local_offset, remote_region,
// remote_offset, length). Every row must name a live local region and a region
// the peer advertised, have length > 0, and stay inside both regions (checked
// without overflow). Local ranges must not overlap each other, nor remote ranges
// each other (compared as absolute addresses, so two region ids over the same
// memory cannot alias). Adjacent rows (both sides contiguous, same mappings) are
// merged into one operation.
#pragma once
#include <ucp/api/ucp.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "registry.h"

namespace kvxfer {

struct RemoteRegion {
    uint64_t id = 0;
    uint64_t addr = 0;
    uint64_t length = 0;
    ucp_rkey_h rkey = nullptr;
    bool is_host = true;
    uintptr_t shm_addr = 0;  // vm path: the region's first byte mapped here (shared_mem.h), else 0
};

struct Op {
    uintptr_t laddr;
    uint64_t raddr;
    size_t length;
    ucp_mem_h memh;
    ucp_rkey_h rkey;
    bool is_host;  // both sides host memory (the vm path may carry it)
    uintptr_t shm;  // raddr mapped into this process (vm path, shared memory), else 0
};

// Throws InvalidDescriptor naming the first offending row.
std::vector<Op> validate_batch(const int64_t* descs, size_t n, const Registry& local,
                               const std::unordered_map<uint64_t, RemoteRegion>& remote);

}  // namespace kvxfer
