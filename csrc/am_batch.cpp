#include "am_batch.h"

#include <cstring>

namespace kvxfer {
namespace {

// Every entry inside one registered host region (overflow-safe); total bytes out.
std::string check_entries(const Registry& registry, const std::vector<BatchEntry>& table, uint64_t& total) {
    const auto regions = registry.all();
    const Region* hit = nullptr;
    total = 0;
    for (const BatchEntry& e : table) {
        if (e.length == 0 || e.length > kBatchMaxBytes) return "malformed entry";
        total += e.length;
        if (hit && e.raddr >= hit->addr && e.raddr - hit->addr <= hit->length &&
            e.length <= hit->length - (e.raddr - hit->addr))
            continue;
        hit = nullptr;
        for (const Region* r : regions) {
            if (r->mapping->kind != MemKind::Host || e.raddr < r->addr) continue;
            const uint64_t off = e.raddr - r->addr;
            if (off <= r->length && e.length <= r->length - off) {
                hit = r;
                break;
            }
        }
        if (!hit) return "range outside the target's registered host regions";
    }
    return total > kBatchMaxBytes ? "message larger than " + std::to_string(kBatchMaxBytes) + " bytes" : "";
}

std::string read_table(const BatchHeader& h, const void* data, size_t length, std::vector<BatchEntry>& table) {
    if (h.count == 0 || h.count > kBatchMaxEntries || h.count > length / sizeof(BatchEntry))
        return "malformed table";
    table.resize(h.count);
    std::memcpy(table.data(), data, h.count * sizeof(BatchEntry));  // the payload may be unaligned
    return {};
}

}  // namespace

std::vector<BatchMsg> plan_batches(const std::vector<Op>& ops, uint64_t token, bool is_write,
                                   size_t max_am_header) {
    std::vector<BatchMsg> out;
    size_t bytes = kBatchMaxBytes;  // forces a new message on the first op
    for (const Op& op : ops) {
        if (!checked_by_target(op)) continue;
        for (size_t off = 0; off < op.length;) {
            if (bytes >= kBatchMaxBytes || out.back().table.size() >= kBatchMaxEntries) {
                out.emplace_back();
                out.back().header = {token, static_cast<uint32_t>(out.size() - 1), 0};
                bytes = 0;
            }
            const size_t n = std::min(op.length - off, kBatchMaxBytes - bytes);
            BatchMsg& m = out.back();
            m.table.push_back({op.raddr + off, n});
            m.iov.push_back({reinterpret_cast<void*>(op.laddr + off), n});
            m.bytes += n;
            bytes += n;
            off += n;
        }
    }
    for (BatchMsg& m : out) {
        m.header.count = static_cast<uint32_t>(m.table.size());
        if (!is_write) continue;
        m.rndv = m.bytes >= kRndvMinBytes && m.bytes < kRndvMaxMeanEntry * m.table.size() &&
                 rndv_header_bytes(m) <= max_am_header;
        if (!m.rndv)  // eager: the table leads the payload
            m.iov.insert(m.iov.begin(), {m.table.data(), m.table.size() * sizeof(BatchEntry)});
    }
    return out;
}

std::string apply_batch(const Registry& registry, const BatchHeader& h, const void* data, size_t length) {
    std::vector<BatchEntry> table;
    std::string why = read_table(h, data, length, table);
    if (!why.empty()) return why;
    uint64_t total = 0;
    why = check_entries(registry, table, total);
    if (!why.empty()) return why;
    const size_t table_bytes = table.size() * sizeof(BatchEntry);
    if (total != length - table_bytes) return "payload length does not match its table";
    const char* src = static_cast<const char*>(data) + table_bytes;
    for (const BatchEntry& e : table) {
        std::memcpy(reinterpret_cast<void*>(e.raddr), src, e.length);
        src += e.length;
    }
    return {};
}

std::string check_rndv_batch(const Registry& registry, const void* header, size_t header_length,
                             size_t data_length, BatchHeader& h, std::vector<BatchEntry>& table) {
    if (header_length < sizeof(BatchHeader)) return "malformed header";
    std::memcpy(&h, header, sizeof(h));
    const size_t table_bytes = header_length - sizeof(BatchHeader);
    if (table_bytes != static_cast<size_t>(h.count) * sizeof(BatchEntry)) return "malformed table";
    std::string why = read_table(h, static_cast<const char*>(header) + sizeof(BatchHeader), table_bytes, table);
    if (!why.empty()) return why;
    uint64_t total = 0;
    why = check_entries(registry, table, total);
    if (!why.empty()) return why;
    return total == data_length ? "" : "payload length does not match its table";
}

std::string check_get(const Registry& registry, const BatchHeader& h, const void* data, size_t length,
                      std::vector<BatchEntry>& table) {
    std::string why = read_table(h, data, length, table);
    if (!why.empty()) return why;
    if (length != table.size() * sizeof(BatchEntry)) return "trailing bytes after the table";
    uint64_t total = 0;
    return check_entries(registry, table, total);
}

}  // namespace kvxfer
