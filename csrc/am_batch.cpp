#include "am_batch.h"

#include <cstring>

namespace kvxfer {

std::vector<BatchMsg> plan_batches(const std::vector<Op>& ops, uint64_t token) {
    std::vector<BatchMsg> out;
    size_t bytes = kBatchMaxBytes;  // forces a new message on the first op
    for (const Op& op : ops) {
        if (!batchable(op)) continue;
        if (bytes + op.length > kBatchMaxBytes) {
            out.emplace_back();
            out.back().header.token = token;
            bytes = 0;
        }
        BatchMsg& m = out.back();
        m.table.push_back({op.raddr, op.length});
        m.iov.push_back({reinterpret_cast<void*>(op.laddr), op.length});
        bytes += op.length;
    }
    for (BatchMsg& m : out) {  // the table leads the payload
        m.header.count = m.table.size();
        m.iov.insert(m.iov.begin(), {m.table.data(), m.table.size() * sizeof(BatchEntry)});
    }
    return out;
}

std::string apply_batch(const Registry& registry, const BatchHeader& h, const void* data, size_t length) {
    if (h.count == 0 || h.count > length / sizeof(BatchEntry)) return "malformed batch table";
    const size_t table_bytes = h.count * sizeof(BatchEntry);
    std::vector<BatchEntry> table(h.count);
    std::memcpy(table.data(), data, table_bytes);  // the payload may be unaligned
    const auto regions = registry.all();
    uint64_t total = 0;
    const Region* hit = nullptr;
    for (const BatchEntry& e : table) {
        if (e.length == 0 || e.length > length) return "malformed batch entry";
        total += e.length;
        if (!(hit && e.raddr >= hit->addr && e.raddr - hit->addr <= hit->length &&
              e.length <= hit->length - (e.raddr - hit->addr))) {
            hit = nullptr;
            for (const Region* r : regions) {
                if (r->mapping->kind != MemKind::Host || e.raddr < r->addr) continue;
                const uint64_t off = e.raddr - r->addr;
                if (off <= r->length && e.length <= r->length - off) {
                    hit = r;
                    break;
                }
            }
            if (!hit) return "batched write outside the target's registered host regions";
        }
    }
    if (total != length - table_bytes) return "batch payload length does not match its table";
    const char* src = static_cast<const char*>(data) + table_bytes;
    for (const BatchEntry& e : table) {
        std::memcpy(reinterpret_cast<void*>(e.raddr), src, e.length);
        src += e.length;
    }
    return {};
}

}  // namespace kvxfer
