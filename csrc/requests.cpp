// Completion of posted requests: polling UCX and the peer's liveness, reaping a
// failed peer's flush, test()/wait(), and the bounded record of finished requests
// (outcomes stay queryable for the last kMaxRetired). Part of Engine (ucx_engine.h).
#include <sched.h>
#include <time.h>

#include <chrono>
#include <string>

#include "errors.h"
#include "ucs_status.h"
#include "ucx_engine.h"

namespace kvxfer {

namespace {

constexpr size_t kMaxRetired = 4096;

void brief_pause() {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, nullptr);
}

}  // namespace

void Engine::retire(uint64_t id) {
    retired_.push_back(id);
    while (retired_.size() > kMaxRetired) {
        requests_.erase(retired_.front());
        retired_.pop_front();
    }
}

void Engine::uncount(XferRequest& r) {
    if (!r.counted) return;
    r.counted = false;
    --num_pending_;
}

// Updates r from UCX and the peer's liveness; true once r is finished.
bool Engine::poll_request(XferRequest& r, uint64_t id) {
    if (r.done) return true;
    if (r.ucx_req) {
        ucs_status_t st = ucp_request_check_status(r.ucx_req);
        if (st != UCS_INPROGRESS) {
            ucp_request_free(r.ucx_req);
            r.ucx_req = nullptr;
            r.status = st;
        }
    }
    if (!r.ucx_req && (r.acks_pending == 0 || r.status != UCS_OK)) {
        uncount(r);
        r.done = true;
        retire(id);
        return true;
    }
    if (r.error.empty()) {
        auto it = conns_.find(r.conn_id);
        if (it == conns_.end()) {
            r.error = "connection closed";
        } else if (it->second->failed) {
            r.error = it->second->failure;
        } else if (it->second->process && !it->second->process->alive()) {
            it->second->failed = true;
            it->second->failure = "peer process " + std::to_string(it->second->process->pid()) + " exited";
            r.error = it->second->failure;
        }
    }
    // A failed peer: the flush request completes (canceled) once the endpoint
    // is closed; report the failure now and let close() reap the request.
    return !r.error.empty();
}

// A request of a failed peer: force-close its endpoint so UCX cancels the
// flush, then free it (keeps num_pending_ honest for deregister()).
void Engine::reap(XferRequest& r) {
    auto it = conns_.find(r.conn_id);
    if (it != conns_.end()) close_ep(*it->second);  // cancels unsent batches too
    r.acks_pending = 0;
    if (r.ucx_req) {
        if (!drain_request(r.ucx_req)) return;  // close() reaps it
        ucp_request_free(r.ucx_req);
        r.ucx_req = nullptr;
    }
    uncount(r);
}

bool Engine::test(uint64_t request_id) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) {
        if (request_id == 0 || request_id >= next_req_)
            throw std::invalid_argument("unknown request " + std::to_string(request_id));
        throw std::invalid_argument("request " + std::to_string(request_id) + " is too old to report");
    }
    if (worker_) ucp_worker_progress(worker_);
    XferRequest& r = it->second;
    if (!poll_request(r, request_id)) return false;
    if (!r.error.empty()) {
        if (!r.done) {
            reap(r);
            r.done = r.ucx_req == nullptr;
            if (r.done) retire(request_id);
        }
        throw PeerDisconnected(r.error);
    }
    if (r.rejected && r.lookup) throw InvalidDescriptor("the peer answers no lookups (or answered one malformed)");
    if (r.rejected)
        throw InvalidDescriptor("the peer refused the transfer: a range outside its registered host memory");
    if (r.status != UCS_OK) {
        if (is_peer_failure(r.status)) throw PeerDisconnected(ucs_error("transfer failed", r.status));
        throw Error(ucs_error("transfer failed", r.status));
    }
    return true;
}

void Engine::wait(uint64_t request_id, double timeout) {
    if (!(timeout >= 0)) throw std::invalid_argument("timeout must be >= 0");
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(std::min(timeout, 1e7)));
    unsigned idle = 0;
    for (;;) {
        if (test(request_id)) return;
        if (std::chrono::steady_clock::now() >= deadline)
            throw TransferTimeout("request " + std::to_string(request_id) + " did not complete within " +
                                  std::to_string(timeout) + " s");
        // Spin briefly (cma/shm complete in the caller's progress), yielding each
        // round, then back off so a wait for a slow peer does not steal a core. The
        // yield hands the CPU to a thread the scheduler queued on it: a same-host peer
        // woken by this request's message runs at once instead of after the spin (on
        // a 2-vCPU VM, 2026-12-05, that packs both on one CPU: a 64-key lookup over TCP
        // after 2 ms idle, p50 326-375 us -> 71-110 us; the node's thread had waited
        // 184-205 us behind the spin, `perf sched timehist`). Alone on its CPU, a yield
        // returns at once.
        if (++idle > 256) brief_pause();
        else sched_yield();
    }
}

}  // namespace kvxfer
