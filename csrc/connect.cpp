// Connections: endpoints to a peer's worker (one, or AgentConfig.tcp_lanes over
// TCP, stripe.h), the peer's unpacked regions, the vm path's probe, closing.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "am_batch.h"
#include "errors.h"
#include "ucs_status.h"
#include "ucx_engine.h"

namespace kvxfer {

namespace {

// The transport of the first rma_bw lane in ucp_ep_print_info's text, e.g.
// "lane[0]:  2:cma/memory.0 md[2] -> md[2]/cma/sysdev[255] rma_bw#0" -> "cma";
// "sysv+am-rma" when UCX has no RMA lane (peer error handling on one host).
std::string rma_transport(const std::string& info) {
    std::istringstream in(info);
    std::string line, fallback;
    while (std::getline(in, line)) {
        auto lane = line.find("lane[");
        if (lane == std::string::npos) continue;
        auto colon = line.find(':', lane);
        if (colon == std::string::npos) continue;
        std::istringstream fields(line.substr(colon + 1));
        std::string tok;
        fields >> tok;  // "2:cma/memory.0"
        auto c = tok.find(':');
        if (c != std::string::npos) tok = tok.substr(c + 1);
        auto slash = tok.find('/');
        std::string tl = tok.substr(0, slash);
        if (line.find("rma_bw") != std::string::npos) return tl;
        if (fallback.empty() && line.find(" am") != std::string::npos) fallback = tl;
    }
    // No RMA lane: UCX emulates put/get with active messages on the am lane.
    return fallback.empty() ? "unknown" : fallback + "+am-rma";
}

std::string ep_print_info(ucp_ep_h ep) {
    char* buf = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&buf, &size);
    if (!f) return {};
    ucp_ep_print_info(ep, f);
    fclose(f);
    std::string out(buf ? buf : "", size);
    free(buf);
    return out;
}

}  // namespace

// Any lane's failure is the connection's: every lane's endpoint reports here.
void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* c = static_cast<PeerConn*>(arg);
    c->failed = true;
    c->failure = ucs_error("peer endpoint failed", status);
}


ucp_ep_h Engine::open_ep(const PeerInfo& info, PeerConn& c) {
    ucp_ep_params_t ep;
    std::memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(info.worker_address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = on_ep_error;
    ep.err_handler.arg = &c;
    ucp_ep_h h = nullptr;
    ucs_status_t st = ucp_ep_create(worker_, &ep, &h);
    if (st != UCS_OK) throw PeerDisconnected(ucs_error("ucp_ep_create", st));
    ++num_endpoints_;
    return h;
}

// Where host ops travel as target-checked messages over TCP, one endpoint per
// lane: UCX gives each ucp_ep to a worker its own TCP socket. Elsewhere (RMA
// lanes, shared memory, the vm path) a second endpoint would share the same
// path, so the connection keeps one.
void Engine::open_lanes(PeerConn& c) {
    if (tcp_lanes_ <= 1 || c.use_vm || c.transport != "ucx:tcp+am-rma") return;
    while (c.lanes.size() < tcp_lanes_) c.lanes.push_back(open_ep(c.peer, c));
}

// vm path: the peer's regions inside its shared allocations become plain memory
// here (shared_mem.h); the pid is checked again after opening, so a pid reused in
// between cannot pass.
void Engine::map_shared(PeerConn& c, const PeerInfo& info) {
    c.segments = std::make_unique<PeerSegments>();
    for (const RegionAd& ad : info.regions) {
        if (ad.kind != 0 || ad.shm.pieces.empty()) continue;
        auto it = c.regions.find(ad.id);
        if (it != c.regions.end()) it->second.shm_addr = c.segments->map(c.process->pid(), ad.shm, ad.length);
    }
    if (!c.process->alive()) {
        for (auto& kv : c.regions) kv.second.shm_addr = 0;
        c.segments.reset();
    }
}

uint64_t Engine::connect(const std::string& peer_metadata, bool allow_vm) {
    PeerInfo info = decode_metadata(peer_metadata);  // ProtocolError before touching UCX
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    auto c = std::make_unique<PeerConn>();
    c->id = next_conn_++;
    c->ep = open_ep(info, *c);
    c->lanes.push_back(c->ep);
    ucs_status_t st;

    for (RegionAd& ad : info.regions) {
        RemoteRegion rr{ad.id, ad.addr, ad.length, nullptr, ad.kind == 0};
        st = ucp_ep_rkey_unpack(c->ep, ad.rkey.data(), &rr.rkey);
        if (st != UCS_OK) {
            close_ep(*c);
            throw ProtocolError("peer region " + std::to_string(ad.id) + ": " + ucs_error("ucp_ep_rkey_unpack", st));
        }
        c->regions[ad.id] = rr;
        ad.rkey.clear();
    }

    if (allow_vm && allow_vm_ && same_host(self_, info)) {
        auto proc = std::make_unique<PeerProcess>(static_cast<pid_t>(info.pid));
        if (proc->alive() && vm_probe(proc->pid(), info.probe_addr, info.probe_length, info.probe_token)) {
            c->process = std::move(proc);
            c->use_vm = true;
            map_shared(*c, info);
        }
    }
    if (!c->use_vm && same_host(self_, info))  // for liveness checks on the UCX path
        c->process = std::make_unique<PeerProcess>(static_cast<pid_t>(info.pid));
    c->ucx_info = ep_print_info(c->ep);
    c->transport = c->use_vm ? "vm" : "ucx:" + rma_transport(c->ucx_info);
    c->am_rma = c->transport.size() > 7 && c->transport.compare(c->transport.size() - 7, 7, "+am-rma") == 0;
    c->peer = std::move(info);
    try {
        open_lanes(*c);
    } catch (...) {
        close_ep(*c);
        throw;
    }
    const uint64_t id = c->id;
    conns_[id] = std::move(c);
    return id;
}

PeerConn& Engine::conn_locked(uint64_t conn_id) {
    auto it = conns_.find(conn_id);
    if (it == conns_.end()) throw std::invalid_argument("unknown connection " + std::to_string(conn_id));
    return *it->second;
}

const PeerConn& Engine::conn(uint64_t conn_id) {
    std::lock_guard<std::mutex> g(mu_);
    return conn_locked(conn_id);
}

// Closing. UCX's TCP transport keeps one socket per endpoint pair, and it closes
// only when both ends' endpoints are gone: ours goes with ucp_ep_close_nbx, but
// the peer's (the one UCX made there for our connection) lives until its worker
// is destroyed, and ours keeps the socket open to receive from it (a flush-mode
// close would even keep our endpoint, since it is connected from the remote
// side). So every lane first says bye; the peer force-closes its endpoint (on_bye),
// and each side's socket closes once it progresses. A dead peer gets no bye: its
// sockets are gone, and UCX destroys its failed endpoint on our side.
void Engine::say_bye(PeerConn& c) {
    if (c.failed) return;
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
    std::vector<void*> reqs;
    for (ucp_ep_h ep : c.lanes) {
        void* req = ucp_am_send_nbx(ep, kByeAmId, nullptr, 0, nullptr, 0, &p);
        if (UCS_PTR_IS_PTR(req)) reqs.push_back(req);
    }
    // Sent (handed to the socket) before the close; the close cancels a straggler.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    for (void* req : reqs) {
        drain_request(req, deadline);
        ucp_request_free(req);  // an unfinished one is released when the close cancels it
    }
}

void Engine::close_ep(PeerConn& c) {
    for (auto& kv : c.regions)
        if (kv.second.rkey) ucp_rkey_destroy(kv.second.rkey);
    c.regions.clear();
    say_bye(c);
    // Force close: transfers were waited for by the caller; a dead peer must not hang us.
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    std::vector<void*> reqs;
    for (ucp_ep_h ep : c.lanes) {
        void* req = ucp_ep_close_nbx(ep, &p);
        --num_endpoints_;
        if (UCS_PTR_IS_PTR(req)) reqs.push_back(req);
    }
    c.lanes.clear();
    c.ep = nullptr;
    // one deadline for all lanes: a dead peer costs kDrainTimeout once, not per lane
    auto deadline = std::chrono::steady_clock::now() + kDrainTimeout;
    for (void* req : reqs) {
        drain_request(req, deadline);
        ucp_request_free(req);
    }
}

// Target: an initiator's lane said bye; force-close the endpoint UCX made for it.
// Closing from inside the handler is safe: UCX destroys the transport endpoint
// from a later progress callback and keeps the UCP one referenced until then;
// requests still on it (a rendezvous receive, a read answer) complete canceled,
// so a Landing never answers on it (landed() answers only on UCS_OK).
ucs_status_t on_bye(void* arg, const void*, size_t, void*, size_t, const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || e->closing_) return UCS_OK;
    ucp_ep_h ep = param->reply_ep;
    // UCX may have matched our own connection to that peer with theirs: never close ours.
    for (auto& kv : e->conns_)
        for (ucp_ep_h own : kv.second->lanes)
            if (own == ep) return UCS_OK;
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);  // released when it completes
    return UCS_OK;
}

void Engine::disconnect(uint64_t conn_id) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = conns_.find(conn_id);
    if (it == conns_.end()) return;  // idempotent
    for (auto& kv : requests_) {
        XferRequest& r = kv.second;
        if (r.conn_id == conn_id && !r.done && r.error.empty()) r.error = "connection closed";
    }
    close_ep(*it->second);
    conns_.erase(it);
}

}  // namespace kvxfer
