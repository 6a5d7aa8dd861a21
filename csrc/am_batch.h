// Batched small writes for endpoints whose RMA UCX emulates with active
// messages (ucx:tcp+am-rma; sysv+am-rma without a cma lane).
//
// There every ucp_put_nbx is one active message with its own header, target
// completion and acknowledgement, so a batch of 4 KiB runs moves at a fraction
// of what the socket carries. kvxfer instead packs up to kBatchMaxBytes of
// small runs into one active message: the data is a table of (remote address,
// length) entries followed by the runs' bytes, gathered by UCX straight from
// the registered source through an iov (no bounce copy). The target, which must
// progress anyway for emulated RMA, validates every entry against its own host
// registrations, copies, and acknowledges; the write completes when every
// message of the batch is acknowledged, so "complete" still means "visible in
// the peer's memory". Nothing is written when any entry is out of bounds.
#pragma once
#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "registry.h"
#include "validate.h"

namespace kvxfer {

constexpr unsigned kBatchAmId = 18;     // initiator -> target: table + bytes
constexpr unsigned kBatchAckAmId = 19;  // target -> initiator: token + status
constexpr size_t kBatchMaxRun = 64 * 1024;       // larger runs go as puts
constexpr size_t kBatchMaxBytes = 1024 * 1024;   // payload bytes per message

struct BatchEntry {
    uint64_t raddr;
    uint64_t length;
};

struct BatchHeader {
    uint64_t token;  // the initiator's request id
    uint64_t count;  // entries in the table
};

struct BatchAck {
    uint64_t token;
    uint32_t status;  // 0: written; 1: rejected (nothing written)
    uint32_t pad;
};

// One active message: its header, table and iov (table first, then the runs).
// Kept alive until the request is finished, as UCX may gather lazily.
struct BatchMsg {
    BatchHeader header{};
    std::vector<BatchEntry> table;
    std::vector<ucp_dt_iov_t> iov;
};

// True for ops the batch path may carry (host memory, small).
inline bool batchable(const Op& op) { return op.is_host && op.length <= kBatchMaxRun; }

// Groups the batchable ops into messages of at most kBatchMaxBytes payload.
std::vector<BatchMsg> plan_batches(const std::vector<Op>& ops, uint64_t token);

// Target side: checks the message layout and that every entry lies inside one
// registered host region, then copies. Returns "" on success, else why it was
// rejected (and nothing was written).
std::string apply_batch(const Registry& registry, const BatchHeader& header, const void* data,
                        size_t length);

}  // namespace kvxfer
