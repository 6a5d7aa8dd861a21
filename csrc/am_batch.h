// Target-checked transfers for endpoints whose RMA UCX emulates with active
// messages (ucx:tcp+am-rma; sysv+am-rma without a cma lane).
//
// There UCX's own emulation (ucp_put_nbx/ucp_get_nbx carried on the am lane)
// writes and reads whatever address the initiator names: the target checks no
// key and no bound. So kvxfer carries every host-memory put and get of such an
// endpoint itself, in messages the *target* validates against its own
// registered host regions (what it advertised; a region deregistered since is
// gone) before it touches a byte:
//
//   write: kBatchAmId  {token, seq, count} + table of (remote address, length)
//          + the bytes (gathered by UCX from the registered source through an
//          iov, no bounce copy); the target checks, copies, and answers
//          kBatchAckAmId {token, seq, status}.
//   read:  kGetAmId    {token, seq, count} + table; the target checks and
//          answers kGetReplyAmId {token, seq, status} + the bytes (gathered by
//          UCX from its memory), which the initiator scatters into the local
//          ranges of message `seq`.
//
// A message of at least kRndvMinBytes, of runs shorter than kRndvMaxMeanEntry
// on average, whose table fits in an AM header (the worker's max_am_header),
// travels by rendezvous instead (measured over veth with 512 KiB TCP segments:
// rendezvous moved 4-8 KiB runs 1.3x faster than eager, eager moved 64-256 KiB
// runs 1.1x faster than rendezvous; docs/benchmarks.md): header = {token, seq,
// count} + table, so the target checks every entry *before* it accepts a byte,
// then receives the data straight into the checked destinations
// (ucp_am_recv_data_nbx with an iov: no staging buffer, no second copy) and
// answers when it landed. A large read answer likewise goes by rendezvous into
// the initiator's local ranges. UCX's rendezvous here runs over the am lane
// (these endpoints have no RMA lane), so no remote key is handed out.
//
// A message carries at most kBatchMaxBytes of data and kBatchMaxEntries
// entries; longer runs are split. A message with any entry outside the
// target's regions is refused whole (nothing of it written or sent) and the
// initiator's request fails with InvalidDescriptor; the request completes when
// every message was answered, so "complete" still means "visible in the peer's
// memory" (write) or "in local memory" (read).
#pragma once
#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "registry.h"
#include "validate.h"

namespace kvxfer {

constexpr unsigned kBatchAmId = 18;     // initiator -> target: write table + bytes
constexpr unsigned kBatchAckAmId = 19;  // target -> initiator: write answered
constexpr unsigned kGetAmId = 20;       // initiator -> target: read table
constexpr unsigned kGetReplyAmId = 21;  // target -> initiator: read answered (+ bytes)
constexpr unsigned kByeAmId = 22;       // initiator -> target: this endpoint closes (connect.cpp)
constexpr unsigned kLookupAmId = 23;       // initiator -> target: key hashes to look up (remote_lookup.cpp)
constexpr unsigned kLookupReplyAmId = 24;  // target -> initiator: one code per key
constexpr size_t kLookupMaxKeys = 4096;    // key hashes per lookup message
constexpr size_t kBatchMaxBytes = 1024 * 1024;  // data bytes per message
constexpr size_t kBatchMaxEntries = 16384;      // table entries per message
constexpr size_t kRndvMinBytes = 64 * 1024;     // messages this large go by rendezvous ...
constexpr size_t kRndvMaxMeanEntry = 64 * 1024; // ... when their runs average less than this

struct BatchEntry {
    uint64_t raddr;
    uint64_t length;
};

struct BatchHeader {
    uint64_t token;  // the initiator's request id
    uint32_t seq;    // message index within the request
    uint32_t count;  // entries in the table
};

struct BatchAck {
    uint64_t token;
    uint32_t seq;
    uint32_t status;  // 0: done; 1: refused (nothing written / sent)
};

// One message of a request, kept alive until the request is finished (UCX may
// gather lazily). Write: iov = the local sources, led by the table when the
// message goes eager. Read: iov = the local destinations (the table alone is sent).
struct BatchMsg {
    BatchHeader header{};
    std::vector<BatchEntry> table;
    std::vector<ucp_dt_iov_t> iov;
    size_t bytes = 0;       // data bytes (sum of the entries)
    bool rndv = false;      // write: the table rides in the header, data by rendezvous
    bool answered = false;  // the answer (or the read data's arrival) was seen
};

// Bytes of a rendezvous write's AM header: BatchHeader then the table.
inline size_t rndv_header_bytes(const BatchMsg& m) {
    return sizeof(BatchHeader) + m.table.size() * sizeof(BatchEntry);
}

// Ops this path carries: host memory on both sides (device memory stays UCX RMA).
inline bool checked_by_target(const Op& op) { return op.is_host; }

// Splits the host ops into messages (at most kBatchMaxBytes / kBatchMaxEntries
// each); a write message goes by rendezvous when it has kRndvMinBytes, its runs
// average under kRndvMaxMeanEntry and its header fits max_am_header (0: never).
std::vector<BatchMsg> plan_batches(const std::vector<Op>& ops, uint64_t token, bool is_write,
                                   size_t max_am_header);

// Target side. Each returns "" on success, else why the message was refused.
// apply_batch checks a write message's layout and every entry, then copies.
std::string apply_batch(const Registry& registry, const BatchHeader& header, const void* data,
                        size_t length);
// check_rndv_batch checks a rendezvous write's header (BatchHeader + table)
// against data_length; on success `h` and `table` hold them.
std::string check_rndv_batch(const Registry& registry, const void* header, size_t header_length,
                             size_t data_length, BatchHeader& h, std::vector<BatchEntry>& table);
// check_get checks a read request; on success `table` holds its entries.
std::string check_get(const Registry& registry, const BatchHeader& header, const void* data, size_t length,
                      std::vector<BatchEntry>& table);

}  // namespace kvxfer
