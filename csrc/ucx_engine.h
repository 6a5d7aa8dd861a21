// The transfer engine: one UCP context + worker per agent, the memory registry,
// connections to peers, batched one-sided writes/reads.
//
// Progress is explicit: nothing runs unless the owner calls test(), wait(),
// progress() or arm(); no background thread. The owner
// learns when UCX has work from event_fd() (UCP_FEATURE_WAKEUP): it becomes
// readable after arm() returned true and something arrived (a connection, an
// active message, a closed socket), so an idle owner can sleep in poll/select
// and still serve emulated RMA and reap closed connections. Every public method
// takes the engine lock, so the engine may be shared by threads, except the
// accessors uid(), event_fd(), closed(), num_rejected(), num_endpoints() and
// num_lookups(), which read one word without it (a snapshot, possibly a step behind).
//
// Completion: a request is complete when test() returns true / wait() returns.
// For a write the bytes are then visible in the peer's memory (UCX path: after
// ucp_ep_flush_nbx completed; vm path: process_vm_writev or the memcpy into the
// peer's shared memory returned in post()).
// For a read the bytes are in local memory.
#pragma once
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "am_batch.h"
#include "metadata.h"
#include "registry.h"
#include "shared_mem.h"
#include "stripe.h"
#include "validate.h"
#include "vm_copy.h"

namespace kvxfer {

// How long a drain (close, reap, deregister) waits for UCX before giving up on a
// request: long enough for a live peer's answer, short enough that a dead one
// never hangs the caller.
constexpr std::chrono::seconds kDrainTimeout{2};

struct PeerConn {
    uint64_t id = 0;
    PeerInfo peer;  // regions' rkey bytes dropped after unpacking
    ucp_ep_h ep = nullptr;          // lane 0: RMA, and every message when there is one lane
    std::vector<ucp_ep_h> lanes;    // every endpoint to the peer, lanes[0] == ep (stripe.h)
    std::unordered_map<uint64_t, RemoteRegion> regions;
    std::unique_ptr<PeerProcess> process;  // same host only
    std::unique_ptr<PeerSegments> segments;  // vm path: the peer's shared memory mapped here
    bool use_vm = false;
    bool am_rma = false;    // UCX emulates RMA with active messages: host ops go target-checked (am_batch.h)
    std::string transport;  // "vm", "ucx:cma", "ucx:tcp", ...
    std::string ucx_info;   // ucp_ep_print_info text
    bool failed = false;
    std::string failure;
};

struct XferRequest {
    uint64_t conn_id = 0;
    void* ucx_req = nullptr;  // flush request still in flight
    size_t acks_pending = 0;  // target-checked messages not yet answered
    std::vector<BatchMsg> batches;  // their buffers, alive until the request is retired
    bool counted = false;     // counted in num_pending_
    bool rejected = false;    // the target refused a message (or answered one malformed)
    bool done = false;
    ucs_status_t status = UCS_OK;
    std::string error;  // set when a failure was decided outside UCX
    // a lookup (remote_lookup.cpp): the hashes sent (alive while UCX may read them), the answer
    bool lookup = false;
    std::vector<uint64_t> lookup_hashes;
    std::string lookup_codes;
};

// Rendezvous data of a checked message being received into this process's
// memory: on the target a write's checked ranges (reply_ep set: answer when it
// landed), on the initiator a read answer's local ranges (reply_ep null).
class Engine;

struct Landing {
    Engine* engine;
    ucp_ep_h reply_ep;
    BatchAck ack;
    std::vector<ucp_dt_iov_t> iov;
    bool counted = false;  // in landings_in_flight_
};

// Active-message handlers of the target-checked path (checked_rma.cpp).
ucs_status_t on_batch(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
ucs_status_t on_batch_ack(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
ucs_status_t on_get(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
ucs_status_t on_get_reply(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
ucs_status_t on_bye(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);  // connect.cpp
// Lookups answered from a served key table (remote_lookup.cpp).
ucs_status_t on_lookup(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
ucs_status_t on_lookup_reply(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
void on_lookup_reply_sent(void*, ucs_status_t, void*);

class Engine {
public:
    // ucx: settings applied with ucp_config_modify (key without the UCX_ prefix; an
    // explicit UCX_<key> in the environment wins); hugepages: "advise", "collapse" or
    // "off" for registered host ranges; tcp_lanes: endpoints (TCP connections) per peer
    // where host ops travel as target-checked messages over TCP, 1..kMaxTcpLanes
    // (stripe.h); vm_split_bytes: same-host batches from this size are split across the
    // process's copy pool (vm_copy.h; 0: never). AgentConfig; kvxfer/transport/ucx.py builds them.
    Engine(bool allow_vm, const std::map<std::string, std::string>& ucx, const std::string& hugepages,
           size_t tcp_lanes = 1, size_t vm_split_bytes = kVmSplitBytes);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    uint64_t uid() const { return self_.uid; }
    Region register_region(uintptr_t addr, size_t length, MemKind kind, int device_id, bool pin);
    void deregister(uint64_t region_id);
    std::vector<Region> regions();
    std::string metadata();

    uint64_t connect(const std::string& peer_metadata, bool allow_vm);
    const PeerConn& conn(uint64_t conn_id);  // throws std::invalid_argument
    void disconnect(uint64_t conn_id);

    // descs: int64 [n, 5], see validate.h. Returns a request id.
    uint64_t post(uint64_t conn_id, bool is_write, const int64_t* descs, size_t n);
    bool test(uint64_t request_id);                  // throws on failure
    void wait(uint64_t request_id, double timeout);  // throws TransferTimeout
    unsigned progress();
    // The worker's event fd (an epoll fd; -1 once closed). Owned by the engine.
    int event_fd() const { return efd_; }
    // Progress until idle, then ucp_worker_arm: true when armed (sleep on
    // event_fd()), false when events are still pending (call again).
    bool arm();

    // Lookups over UCX (remote_lookup.cpp). serve_key_table: answer peers' lookups from
    // the key table at base (key_table.h; the caller keeps it mapped until close()).
    // post_lookup: ask the peer of conn_id about up to kLookupMaxKeys key hashes
    // (key_table_hash); complete through test()/wait() like a transfer (a peer that
    // serves no table refuses: InvalidDescriptor), then lookup_result() gives one byte a
    // key, as key_table_find. Not for the vm path (map the peer's table instead).
    void serve_key_table(uintptr_t base, uint64_t nbuckets);
    uint64_t post_lookup(uint64_t conn_id, const uint64_t* hashes, size_t n);
    std::string lookup_result(uint64_t request_id);
    // Lookups this engine answered as a target from its served table.
    uint64_t num_lookups() const { return num_lookups_; }

    void close();
    bool closed() const { return worker_ == nullptr; }
    // Messages this engine refused as a target (ranges outside its regions).
    uint64_t num_rejected() const { return num_rejected_; }
    // Endpoints this engine opened to peers (connect) and has not closed yet.
    size_t num_endpoints() const { return num_endpoints_; }

private:
    friend void on_ep_error(void*, ucp_ep_h, ucs_status_t);
    friend ucs_status_t on_batch(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend ucs_status_t on_batch_ack(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend ucs_status_t on_get(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend ucs_status_t on_get_reply(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend void on_get_reply_sent(void*, ucs_status_t, void*);
    friend ucs_status_t on_bye(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend void on_landed(void*, ucs_status_t, size_t, void*);
    friend ucs_status_t on_lookup(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend ucs_status_t on_lookup_reply(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*);
    friend void on_lookup_reply_sent(void*, ucs_status_t, void*);

    void require_open() const;
    // Progress the worker until busy() is false or deadline passes; true when no longer
    // busy. Every drain that must not hang on a dead peer goes through this.
    template <class Busy>
    bool progress_while(Busy busy, std::chrono::steady_clock::time_point deadline) {
        while (busy() && std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
        return !busy();
    }
    // Destroy the worker and the context (those that exist); the one UCX teardown,
    // used by close() and by a constructor that failed part-way.
    void release_ucx();
    // Drain one UCX request until `deadline` (default: kDrainTimeout from now; callers
    // draining several share one); true when it completed. The one request drain.
    bool drain_request(void* req,
                       std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() + kDrainTimeout);
    PeerConn& conn_locked(uint64_t conn_id);
    bool poll_request(XferRequest& r, uint64_t id);
    void retire(uint64_t id);
    void reap(XferRequest& r);
    void uncount(XferRequest& r);
    void post_rma(PeerConn& c, XferRequest& r, const std::vector<Op>& ops, bool is_write, bool checked);
    // checked_rma.cpp: the target-checked path of am_rma endpoints.
    void post_batches(PeerConn& c, XferRequest& r, const std::vector<Op>& ops, uint64_t id, bool is_write);
    BatchMsg* pending_message(uint64_t token, uint32_t seq, XferRequest*& r);
    BatchMsg* take_answer(const void* header, size_t header_length, BatchAck& ack, XferRequest*& r);
    void receive(void* desc, Landing* l);  // takes l
    void landed(Landing& l, ucs_status_t status);
    void set_am_handler(unsigned id, ucp_am_recv_callback_t cb);
    void open_worker();  // constructor: worker, event fd, AM handlers, address
    void close_ep(PeerConn& c);
    ucp_ep_h open_ep(const PeerInfo& info, PeerConn& c);  // connect.cpp; throws PeerDisconnected
    void open_lanes(PeerConn& c);                         // connect.cpp: the extra TCP lanes
    void say_bye(PeerConn& c);                            // connect.cpp: before close_ep
    void map_shared(PeerConn& c, const PeerInfo& info);   // connect.cpp: vm path, shared memory

    std::mutex mu_;
    bool allow_vm_;
    ucp_context_h context_ = nullptr;
    ucp_worker_h worker_ = nullptr;
    int efd_ = -1;
    std::unique_ptr<Registry> registry_;
    PeerInfo self_;
    alignas(64) char probe_[kProbeBytes] = {0};
    uint64_t next_conn_ = 1, next_req_ = 1;
    uint64_t token_salt_ = 0;  // request id ^ salt = token on the wire (am_batch.h)
    std::unordered_map<uint64_t, std::unique_ptr<PeerConn>> conns_;
    std::unordered_map<uint64_t, XferRequest> requests_;
    std::deque<uint64_t> retired_;
    size_t num_pending_ = 0;
    size_t replies_in_flight_ = 0;  // read answers UCX may still gather from our memory
    size_t landings_in_flight_ = 0;  // rendezvous data UCX may still write into our memory
    size_t max_am_header_ = 0;       // the worker's largest AM header (rendezvous tables)
    bool closing_ = false;
    uint64_t num_rejected_ = 0;
    uintptr_t table_base_ = 0;  // the served key table (0: none; lookups are refused)
    uint64_t table_buckets_ = 0;
    uint64_t num_lookups_ = 0;
    size_t tcp_lanes_ = 1;
    size_t vm_split_bytes_ = kVmSplitBytes;
    size_t num_endpoints_ = 0;
};

}  // namespace kvxfer
