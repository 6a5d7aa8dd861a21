// Lookups of a store node's key table (key_table.h) by peers that do not map it (other
// hosts), answered inside the node's UCX progress: no socket request, no Python.
//
//   kLookupAmId       initiator -> target  header {token, count, 0} + count key hashes (u64)
//   kLookupReplyAmId  target -> initiator  header {token, count, status} + count codes (u8)
//
// Both go eager (a request carries at most kLookupMaxKeys hashes: 32 KiB). The target
// answers from the table it serves (Engine::serve_key_table) with key_table_find_hashed:
// 1 present, 0 absent, 2 unknown (the key's bucket overflowed: ask the node). A target
// that serves no table, or a request whose length does not match its count, is refused
// (status 1, no codes) and counted in num_rejected. The initiator takes an answer only
// for a lookup it is waiting for (the token is the request id xor a random salt, as for
// the checked transfers: am_batch.h), only with as many codes as it sent hashes, and
// reads any code above 2 as unknown. A refused or malformed answer fails the request
// with InvalidDescriptor; the caller then asks the node another way.
//
// The target reads the table while its own thread (the node's I/O thread, which also
// drives this progress) may change it; every word is read atomically, and an answer is
// advice either way (key_table.h).
#include <cstring>

#include "errors.h"
#include "key_table.h"
#include "ucs_status.h"
#include "ucx_engine.h"

namespace kvxfer {
namespace {

struct LookupHeader {
    uint64_t token;
    uint32_t count;
    uint32_t status;  // 0: answered; 1: refused (no codes)
};

// An answer in flight: its header and codes, alive until UCX has sent them.
struct LookupReply {
    Engine* engine;
    LookupHeader header;
    std::string codes;
};

bool is_rndv(const ucp_am_recv_param_t* param) { return param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV; }

}  // namespace

void on_lookup_reply_sent(void* request, ucs_status_t, void* user_data) {
    auto* reply = static_cast<LookupReply*>(user_data);
    --reply->engine->replies_in_flight_;
    delete reply;
    ucp_request_free(request);
}

// Target: one lookup, answered at once from the served table.
ucs_status_t on_lookup(void* arg, const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (header_length != sizeof(LookupHeader) || !header || is_rndv(param) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return UCS_OK;
    LookupHeader h;
    std::memcpy(&h, header, sizeof(h));
    auto* reply = new LookupReply{e, {h.token, 0, 1u}, {}};
    if (e->table_base_ != 0 && h.count >= 1 && h.count <= kLookupMaxKeys &&
        length == size_t(h.count) * sizeof(uint64_t) && data != nullptr) {
        std::vector<uint64_t> hashes(h.count);
        std::memcpy(hashes.data(), data, length);  // the AM data need not be aligned
        reply->codes.resize(h.count);
        key_table_find_hashed(e->table_base_, e->table_buckets_, hashes.data(), h.count,
                              reinterpret_cast<uint8_t*>(reply->codes.data()));
        reply->header.count = h.count;
        reply->header.status = 0;
        ++e->num_lookups_;
    } else {
        ++e->num_rejected_;
    }
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    p.cb.send = on_lookup_reply_sent;
    p.user_data = reply;
    void* req = ucp_am_send_nbx(param->reply_ep, kLookupReplyAmId, &reply->header, sizeof(reply->header),
                                reply->codes.data(), reply->codes.size(), &p);
    if (UCS_PTR_IS_PTR(req))
        ++e->replies_in_flight_;  // on_lookup_reply_sent frees it
    else
        delete reply;  // sent at once, or failed (the initiator sees its endpoint fail)
    return UCS_OK;
}

// Initiator: the answer to a lookup this engine waits for; anything else is dropped.
ucs_status_t on_lookup_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (header_length != sizeof(LookupHeader) || !header || is_rndv(param)) return UCS_OK;
    LookupHeader h;
    std::memcpy(&h, header, sizeof(h));
    auto it = e->requests_.find(h.token ^ e->token_salt_);
    if (it == e->requests_.end()) return UCS_OK;
    XferRequest& r = it->second;
    if (!r.lookup || r.done || r.acks_pending == 0) return UCS_OK;
    if (h.status != 0 || h.count != r.lookup_hashes.size() || length != h.count || data == nullptr) {
        r.rejected = true;
    } else {
        r.lookup_codes.assign(static_cast<const char*>(data), length);
        for (char& c : r.lookup_codes)
            if (static_cast<uint8_t>(c) > 2) c = 2;  // not a code: unknown
    }
    --r.acks_pending;
    return UCS_OK;
}

void Engine::serve_key_table(uintptr_t base, uint64_t nbuckets) {
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    if (base == 0) throw std::invalid_argument("serve_key_table: null base");
    key_table_bytes(nbuckets);  // checks the geometry
    table_base_ = base;
    table_buckets_ = nbuckets;
}

uint64_t Engine::post_lookup(uint64_t conn_id, const uint64_t* hashes, size_t n) {
    if (n == 0 || n > kLookupMaxKeys)
        throw std::invalid_argument("a lookup asks about 1.." + std::to_string(kLookupMaxKeys) + " keys, not " +
                                    std::to_string(n));
    std::lock_guard<std::mutex> g(mu_);
    require_open();
    PeerConn& c = conn_locked(conn_id);
    if (c.failed) throw PeerDisconnected(c.failure);
    if (c.lanes.empty()) throw PeerDisconnected("connection closed");
    if (c.use_vm) throw std::invalid_argument("a same-host peer's key table is read where it is mapped");
    const uint64_t id = next_req_++;
    XferRequest r;
    r.conn_id = conn_id;
    r.lookup = true;
    r.acks_pending = 1;
    r.lookup_hashes.assign(hashes, hashes + n);
    const LookupHeader h{id ^ token_salt_, static_cast<uint32_t>(n), 0u};
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
    // the hashes' buffer moves with r into requests_ (a vector's move keeps its storage),
    // so it stays valid while UCX may still read it
    void* req = ucp_am_send_nbx(c.ep, kLookupAmId, &h, sizeof(h), r.lookup_hashes.data(),
                                n * sizeof(uint64_t), &p);
    if (UCS_PTR_IS_ERR(req)) {
        const ucs_status_t st = UCS_PTR_STATUS(req);
        if (is_peer_failure(st)) throw PeerDisconnected(ucs_error("lookup", st));
        throw Error(ucs_error("lookup", st));
    }
    if (req != nullptr) r.ucx_req = req;
    requests_[id] = std::move(r);
    return id;
}

std::string Engine::lookup_result(uint64_t request_id) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second.lookup)
        throw std::invalid_argument("request " + std::to_string(request_id) + " is no lookup on record");
    const XferRequest& r = it->second;
    if (!r.done || r.rejected || !r.error.empty() || r.status != UCS_OK ||
        r.lookup_codes.size() != r.lookup_hashes.size())
        throw std::invalid_argument("lookup " + std::to_string(request_id) + " has no answer (wait for it first)");
    return r.lookup_codes;
}

}  // namespace kvxfer
