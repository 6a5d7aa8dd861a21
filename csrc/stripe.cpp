#include "stripe.h"

#include <algorithm>

#include "am_batch.h"

namespace kvxfer {

size_t stripe_count(size_t bytes, size_t lanes) {
    return std::max<size_t>(1, std::min(lanes, bytes / kStripeMinBytes));
}

std::vector<std::vector<Op>> stripe_ops(const std::vector<Op>& ops, size_t n) {
    size_t total = 0;
    for (const Op& op : ops)
        if (checked_by_target(op)) total += op.length;
    n = std::max<size_t>(n, 1);
    std::vector<std::vector<Op>> out(n);
    // Range k holds bytes [k * total / n, (k + 1) * total / n).
    size_t k = 0, done = 0;  // done: bytes assigned so far
    for (const Op& op : ops) {
        if (!checked_by_target(op)) continue;
        for (size_t off = 0; off < op.length;) {
            size_t end = (k + 1) * total / n;
            while (done >= end && k + 1 < n) end = (++k + 1) * total / n;
            const size_t take = std::min(op.length - off, end - done);
            Op part = op;
            part.laddr += off;
            part.raddr += off;
            part.length = take;
            out[k].push_back(part);
            off += take;
            done += take;
        }
    }
    return out;
}

}  // namespace kvxfer
