#include "validate.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace kvxfer {
namespace {

[[noreturn]] void bad(size_t row, const std::string& why) {
    throw InvalidDescriptor("descriptor " + std::to_string(row) + ": " + why);
}

struct Span {
    uint64_t start, end;
    size_t row;
};

// Sorts only when needed (batches usually arrive in order), then checks neighbours.
void check_disjoint(std::vector<Span>& spans, const char* side) {
    bool sorted = true;
    for (size_t i = 1; i < spans.size() && sorted; ++i) sorted = spans[i - 1].start <= spans[i].start;
    if (!sorted)
        std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
    for (size_t i = 1; i < spans.size(); ++i) {
        if (spans[i].start < spans[i - 1].end)
            bad(std::max(spans[i].row, spans[i - 1].row),
                std::string(side) + " range overlaps descriptor " +
                    std::to_string(std::min(spans[i].row, spans[i - 1].row)));
    }
}

}  // namespace

std::vector<Op> validate_batch(const int64_t* d, size_t n, const Registry& local,
                               const std::unordered_map<uint64_t, RemoteRegion>& remote) {
    std::vector<Op> ops;
    ops.reserve(n);
    std::vector<Span> lspans(n), rspans(n);
    // Rows usually name the same regions; remember the last lookup.
    int64_t last_lid = -1, last_rid = -1;
    const Region* lr = nullptr;
    const RemoteRegion* rr = nullptr;
    for (size_t i = 0; i < n; ++i) {
        const int64_t* row = d + 5 * i;
        const int64_t lid = row[0], loff = row[1], rid = row[2], roff = row[3], len = row[4];
        if (len <= 0) bad(i, len == 0 ? "zero length" : "negative length");
        if (loff < 0 || roff < 0) bad(i, "negative offset");
        if (lid != last_lid) {
            lr = lid < 0 ? nullptr : local.find(static_cast<uint64_t>(lid));
            if (!lr) bad(i, "local region " + std::to_string(lid) + " is not registered");
            last_lid = lid;
        }
        if (rid != last_rid) {
            auto it = rid < 0 ? remote.end() : remote.find(static_cast<uint64_t>(rid));
            if (it == remote.end()) bad(i, "remote region " + std::to_string(rid) + " was not advertised by the peer");
            rr = &it->second;
            last_rid = rid;
        }
        const uint64_t ulen = static_cast<uint64_t>(len);
        if (static_cast<uint64_t>(loff) > lr->length || ulen > lr->length - static_cast<uint64_t>(loff))
            bad(i, "local range runs past region " + std::to_string(lid));
        if (static_cast<uint64_t>(roff) > rr->length || ulen > rr->length - static_cast<uint64_t>(roff))
            bad(i, "remote range runs past region " + std::to_string(rid));
        const uintptr_t laddr = lr->addr + static_cast<uintptr_t>(loff);
        const uint64_t raddr = rr->addr + static_cast<uint64_t>(roff);
        lspans[i] = {laddr, laddr + ulen, i};
        rspans[i] = {raddr, raddr + ulen, i};
        ucp_mem_h memh = lr->mapping->memh;
        const uintptr_t shm = rr->shm_addr ? rr->shm_addr + static_cast<uintptr_t>(roff) : 0;
        if (!ops.empty()) {
            Op& p = ops.back();
            if (p.memh == memh && p.rkey == rr->rkey && p.laddr + p.length == laddr &&
                p.raddr + p.length == raddr && (p.shm ? p.shm + p.length == shm : shm == 0)) {
                p.length += ulen;
                continue;
            }
        }
        ops.push_back({laddr, raddr, static_cast<size_t>(ulen), memh, rr->rkey,
                       rr->is_host && lr->mapping->kind == MemKind::Host, shm});
    }
    check_disjoint(lspans, "local");
    check_disjoint(rspans, "remote");
    return ops;
}

}  // namespace kvxfer
