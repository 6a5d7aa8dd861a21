#include "ucx_engine.h"

#include <unistd.h>

#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "errors.h"
#include "ucs_status.h"

namespace kvxfer {

void Engine::set_am_handler(unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t ap;
    std::memset(&ap, 0, sizeof(ap));
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = id;
    ap.cb = cb;
    ap.arg = this;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) throw Error(ucs_error("ucp_worker_set_am_recv_handler", st));
}

// The worker, its event fd, AM handlers and address; throws with worker_ set as far
// as it got (the constructor releases it).
void Engine::open_worker() {
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the engine lock serializes callers
    ucs_status_t st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) {
        worker_ = nullptr;
        throw Error(ucs_error("ucp_worker_create", st));
    }
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) throw Error(ucs_error("ucp_worker_get_efd", st));
    ucp_worker_attr_t wa;
    std::memset(&wa, 0, sizeof(wa));
    wa.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    st = ucp_worker_query(worker_, &wa);
    if (st != UCS_OK) throw Error(ucs_error("ucp_worker_query", st));
    max_am_header_ = wa.max_am_header;
    set_am_handler(kBatchAmId, on_batch);
    set_am_handler(kBatchAckAmId, on_batch_ack);
    set_am_handler(kGetAmId, on_get);
    set_am_handler(kGetReplyAmId, on_get_reply);
    set_am_handler(kByeAmId, on_bye);
    set_am_handler(kLookupAmId, on_lookup);
    set_am_handler(kLookupReplyAmId, on_lookup_reply);

    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) throw Error(ucs_error("ucp_worker_get_address", st));
    self_.worker_address.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);
}

bool Engine::drain_request(void* req, std::chrono::steady_clock::time_point deadline) {
    return progress_while([req] { return ucp_request_check_status(req) == UCS_INPROGRESS; }, deadline);
}

Engine::Engine(bool allow_vm, const std::map<std::string, std::string>& ucx, const std::string& hugepages,
               size_t tcp_lanes, size_t vm_split_bytes)
    : allow_vm_(allow_vm), tcp_lanes_(tcp_lanes), vm_split_bytes_(vm_split_bytes) {
    if (hugepages != "advise" && hugepages != "collapse" && hugepages != "off")
        throw std::invalid_argument("hugepages must be advise, collapse or off, got '" + hugepages + "'");
    if (tcp_lanes < 1 || tcp_lanes > kMaxTcpLanes)
        throw std::invalid_argument("tcp_lanes must be 1.." + std::to_string(kMaxTcpLanes) + ", got " +
                                    std::to_string(tcp_lanes));
    ucp_config_t* raw_config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
    if (st != UCS_OK) throw Error(ucs_error("ucp_config_read", st));
    // released on every path out of here (ucp_init copies what it needs)
    const std::unique_ptr<ucp_config_t, void (*)(ucp_config_t*)> config(raw_config, ucp_config_release);
    // The settings kvxfer/transport/ucx.py passes: its defaults (TCP segment size, cma
    // RMA, the agent's network device; why: see UCX_DEFAULTS there) and AgentConfig.ucx.
    // An explicit UCX_<key> in the environment wins, as UCX's own rule.
    for (const auto& kv : ucx) {
        if (std::getenv(("UCX_" + kv.first).c_str())) continue;
        st = ucp_config_modify(config.get(), kv.first.c_str(), kv.second.c_str());
        if (st != UCS_OK)
            throw Error(ucs_error(("ucp_config_modify(" + kv.first + "=" + kv.second + ")").c_str(), st));
    }
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config.get(), &context_);
    if (st != UCS_OK) throw Error(ucs_error("ucp_init", st));
    try {
        open_worker();
        std::random_device rd;
        self_.uid = (static_cast<uint64_t>(rd()) << 32) ^ rd();
        token_salt_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
        for (size_t i = 0; i < kProbeTokenBytes; ++i) probe_[i] = static_cast<char>(rd());
        fill_host_identity(self_);
        self_.probe_addr = reinterpret_cast<uint64_t>(probe_);
        self_.probe_length = kProbeBytes;
        self_.probe_token.assign(probe_, kProbeTokenBytes);
        registry_ = std::make_unique<Registry>(context_, hugepages);
    } catch (...) {
        release_ucx();  // whatever step failed
        throw;
    }
}

void Engine::release_ucx() {
    if (worker_) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    efd_ = -1;
    if (context_) ucp_cleanup(context_);
    context_ = nullptr;
}

Engine::~Engine() {
    try {
        close();
    } catch (...) {
    }
}

void Engine::require_open() const {
    if (!worker_) throw Error("the engine is closed");
}

Region Engine::register_region(uintptr_t addr, size_t length, MemKind kind, int device_id, bool pin) {
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    return registry_->add(addr, length, kind, device_id, pin);
}

void Engine::deregister(uint64_t region_id) {
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    // In-flight UCX operations may still read the mapping; refuse rather than race.
    if (num_pending_ > 0)
        throw RegistrationError("cannot deregister while " + std::to_string(num_pending_) +
                                " transfer(s) are in flight; wait for them first");
    // Answers to peers' reads may still be gathered from our memory, peers'
    // writes may still be landing in it: let them finish.
    if (!progress_while([this] { return replies_in_flight_ > 0 || landings_in_flight_ > 0; },
                        std::chrono::steady_clock::now() + kDrainTimeout))
        throw RegistrationError("cannot deregister while " + std::to_string(replies_in_flight_ + landings_in_flight_) +
                                " peer read(s)/write(s) of this process's memory are in flight");
    registry_->remove(region_id);
}

std::vector<Region> Engine::regions() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Region> out;
    if (!registry_) return out;
    for (const Region* r : registry_->all()) out.push_back(*r);
    return out;
}

std::string Engine::metadata() {
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    PeerInfo info = self_;
    for (const Region* r : registry_->all()) {
        RegionAd ad{r->id, r->addr, r->length, static_cast<uint32_t>(r->mapping->kind), r->mapping->rkey, {}};
        if (r->mapping->kind == MemKind::Host) ad.shm = shared_lookup(r->addr, r->length);
        info.regions.push_back(std::move(ad));
    }
    return encode_metadata(info);
}

uint64_t Engine::post(uint64_t conn_id, bool is_write, const int64_t* descs, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    PeerConn& c = conn_locked(conn_id);
    if (c.failed) throw PeerDisconnected(c.failure);
    if (c.lanes.empty()) throw PeerDisconnected("connection closed");
    std::vector<Op> ops = validate_batch(descs, n, *registry_, c.regions);
    if (c.process && !c.process->alive()) {
        c.failed = true;
        c.failure = "peer process " + std::to_string(c.process->pid()) + " exited";
        throw PeerDisconnected(c.failure);
    }
    const uint64_t id = next_req_++;
    XferRequest r;
    r.conn_id = conn_id;
    bool all_host = true;
    for (const Op& op : ops) all_host = all_host && op.is_host;
    if (c.use_vm && all_host) {  // device memory goes through UCX (cuda_ipc on one host)
        vm_transfer(c.process->pid(), ops, is_write, vm_split_bytes_);
        // A peer that died during a copy into its shared memory raised nothing.
        if (!c.process->alive()) {
            c.failed = true;
            c.failure = "peer process " + std::to_string(c.process->pid()) + " exited";
            throw PeerDisconnected(c.failure);
        }
        r.done = true;  // the copy finished inside post()
        requests_[id] = std::move(r);
        retire(id);
        return id;
    }
    // Where UCX emulates RMA it would apply any address a peer names; kvxfer's own
    // messages let the target check every range (am_batch.h).
    const bool checked = c.am_rma;
    try {
        if (checked) post_batches(c, r, ops, id, is_write);
        post_rma(c, r, ops, is_write, checked);
    } catch (...) {
        // Messages already handed to UCX may still read their tables and iovs:
        // keep them with a failed request until it is retired.
        r.error = "post failed";
        r.acks_pending = 0;
        r.done = true;
        requests_[id] = std::move(r);
        retire(id);
        throw;
    }
    if (!r.done && (r.ucx_req || r.acks_pending)) {
        r.counted = true;
        ++num_pending_;
    } else {
        r.done = true;
    }
    XferRequest& stored = requests_[id] = std::move(r);
    if (stored.done) retire(id);
    return id;
}

// Puts/gets every op the target-checked path does not carry, then one flush.
void Engine::post_rma(PeerConn& c, XferRequest& r, const std::vector<Op>& ops, bool is_write, bool checked) {
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    size_t posted = 0;
    for (const Op& op : ops) {
        if (checked && checked_by_target(op)) continue;
        ++posted;
        p.memh = op.memh;
        void* req = is_write ? ucp_put_nbx(c.ep, reinterpret_cast<void*>(op.laddr), op.length, op.raddr, op.rkey, &p)
                             : ucp_get_nbx(c.ep, reinterpret_cast<void*>(op.laddr), op.length, op.raddr, op.rkey, &p);
        if (UCS_PTR_IS_ERR(req)) {
            ucs_status_t st = UCS_PTR_STATUS(req);
            if (c.failed || is_peer_failure(st)) throw PeerDisconnected(ucs_error(is_write ? "ucp_put_nbx" : "ucp_get_nbx", st));
            throw Error(ucs_error(is_write ? "ucp_put_nbx" : "ucp_get_nbx", st));
        }
        if (req) ucp_request_free(req);  // released by UCX on completion; the flush below covers it
    }
    if (posted == 0) return;  // nothing for a flush to cover
    ucp_request_param_t fp;
    std::memset(&fp, 0, sizeof(fp));
    void* flush = ucp_ep_flush_nbx(c.ep, &fp);
    if (UCS_PTR_IS_ERR(flush)) {
        r.done = true;
        r.status = UCS_PTR_STATUS(flush);
    } else if (flush != nullptr) {
        r.ucx_req = flush;
    }
}

unsigned Engine::progress() {
    std::lock_guard<std::mutex> g(mu_);
    if (!worker_) return 0;
    unsigned n = 0, k;
    while ((k = ucp_worker_progress(worker_)) != 0 && n < 1024) n += k;
    return n;
}

bool Engine::arm() {
    // A stream of segments (a large write into this target over TCP) would cost one
    // event-fd wake-up, and one trip through the owner's event loop, per segment or
    // two. So once this call made progress, keep progressing until UCX has been idle
    // for kArmLinger (the next segment of a stream arrives well within it), and only
    // then arm. The lock is dropped between polls so initiators in this process
    // can post; kArmMaxSpin bounds one call (false: not armed, call again soon).
    using clock = std::chrono::steady_clock;
    constexpr auto kArmLinger = std::chrono::microseconds(100);
    constexpr auto kArmMaxSpin = std::chrono::milliseconds(5);
    const auto began = clock::now();
    auto last_work = began;
    bool progressed = false;
    for (;;) {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (!worker_) return true;
            bool did = false;
            for (int i = 0; i < 1024 && ucp_worker_progress(worker_) != 0; ++i) did = true;
            const auto now = clock::now();
            if (did) {
                progressed = true;
                last_work = now;
            } else if (!progressed || now - last_work >= kArmLinger) {
                ucs_status_t st = ucp_worker_arm(worker_);
                if (st == UCS_OK) return true;
                if (st != UCS_ERR_BUSY) throw Error(ucs_error("ucp_worker_arm", st));
                last_work = now;  // events came in meanwhile: keep going
            }
            if (now - began >= kArmMaxSpin) return false;
        }
        if (progressed) std::this_thread::yield();
    }
}

void Engine::close() {
    std::lock_guard<std::mutex> g(mu_);
    if (!worker_) return;
    closing_ = true;  // rendezvous data canceled from here on gets no answer
    for (auto& kv : conns_) close_ep(*kv.second);
    for (auto& kv : requests_) {
        XferRequest& r = kv.second;
        if (!r.ucx_req) continue;
        drain_request(r.ucx_req);
        ucp_request_free(r.ucx_req);
        r.ucx_req = nullptr;
    }
    num_pending_ = 0;
    conns_.clear();
    requests_.clear();
    retired_.clear();
    registry_->clear();
    release_ucx();
}

}  // namespace kvxfer
