// Striping one request over several TCP connections ("lanes") to one peer.
//
// Over UCX's TCP transport one ucp_ep is one TCP socket, and one socket over a
// veth tops out at one native stream (iperf3 -P 1). With AgentConfig.tcp_lanes
// = N the engine opens N endpoints to the peer's worker (each its own socket,
// csrc/connect.cpp) and, on endpoints whose host ops travel as target-checked
// messages (am_batch.h), splits a request's host bytes into N contiguous ranges
// of near-equal size, one per lane. Each lane's range is planned into messages
// on its own (plan_batches) and sent on its endpoint; the request completes
// when every message of every lane was answered, and fails (PeerDisconnected,
// InvalidDescriptor) when any lane does: the target checks every message
// exactly as on one lane.
#pragma once
#include <cstddef>
#include <vector>

#include "validate.h"

namespace kvxfer {

constexpr size_t kMaxTcpLanes = 16;
// A lane carries at least this many bytes of a request: smaller requests use
// fewer lanes (one message's worth gains nothing from a second socket).
constexpr size_t kStripeMinBytes = 256 * 1024;

// Lanes a request of `bytes` target-checked bytes uses on a connection of `lanes`.
size_t stripe_count(size_t bytes, size_t lanes);

// The target-checked ops (checked_by_target) of `ops`, in order, cut into `n`
// contiguous ranges whose byte counts differ by at most one; an op spanning a
// boundary is split there. Other ops are left out. n >= 1.
std::vector<std::vector<Op>> stripe_ops(const std::vector<Op>& ops, size_t n);

}  // namespace kvxfer
