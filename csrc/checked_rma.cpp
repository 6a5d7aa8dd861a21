// The engine's target-checked transfer path (am_batch.h): initiator posting and
// the four active-message handlers. Handlers run inside ucp_worker_progress,
// i.e. with the engine lock held by whichever engine call progressed.
#include <cstring>

#include "errors.h"
#include "ucs_status.h"
#include "ucx_engine.h"

namespace kvxfer {
namespace {

// A read answer in flight: its header and the iov over this process's memory.
struct GetReply {
    Engine* engine;
    BatchAck ack;
    std::vector<ucp_dt_iov_t> iov;
};

void send_answer(ucp_ep_h ep, unsigned id, const BatchAck& ack) {
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    void* req = ucp_am_send_nbx(ep, id, &ack, sizeof(ack), nullptr, 0, &p);
    if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);  // header copied; UCX releases it when sent
}

bool usable(const void* header, size_t header_length, size_t expect, const ucp_am_recv_param_t* param) {
    // Senders force eager protocol; anything else is not ours and is dropped.
    return header_length == expect && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && header != nullptr;
}

}  // namespace

void on_get_reply_sent(void* request, ucs_status_t, void* user_data) {
    auto* reply = static_cast<GetReply*>(user_data);
    --reply->engine->replies_in_flight_;
    delete reply;
    ucp_request_free(request);
}

// Target: a write message. Check every entry, copy, answer.
ucs_status_t on_batch(void* arg, const void* header, size_t header_length, void* data, size_t length,
                      const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (!usable(header, header_length, sizeof(BatchHeader), param)) return UCS_OK;
    BatchHeader h;
    std::memcpy(&h, header, sizeof(h));
    const bool ok = apply_batch(*e->registry_, h, data, length).empty();
    if (!ok) ++e->num_rejected_;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
        send_answer(param->reply_ep, kBatchAckAmId, {h.token, h.seq, ok ? 0u : 1u});
    return UCS_OK;
}

// Target: a read request. Check every entry, then send the bytes straight from
// this process's memory (UCX gathers them through the iov; the request stays
// counted in replies_in_flight_ until UCX is done reading).
ucs_status_t on_get(void* arg, const void* header, size_t header_length, void* data, size_t length,
                    const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (!usable(header, header_length, sizeof(BatchHeader), param) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return UCS_OK;
    BatchHeader h;
    std::memcpy(&h, header, sizeof(h));
    std::vector<BatchEntry> table;
    if (!check_get(*e->registry_, h, data, length, table).empty()) {
        ++e->num_rejected_;
        send_answer(param->reply_ep, kGetReplyAmId, {h.token, h.seq, 1u});
        return UCS_OK;
    }
    auto* reply = new GetReply{e, {h.token, h.seq, 0u}, {}};
    reply->iov.reserve(table.size());
    for (const BatchEntry& t : table) reply->iov.push_back({reinterpret_cast<void*>(t.raddr), t.length});
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    p.datatype = ucp_dt_make_iov();
    p.cb.send = on_get_reply_sent;
    p.user_data = reply;
    void* req = ucp_am_send_nbx(param->reply_ep, kGetReplyAmId, &reply->ack, sizeof(reply->ack),
                                reply->iov.data(), reply->iov.size(), &p);
    if (UCS_PTR_IS_PTR(req))
        ++e->replies_in_flight_;  // on_get_reply_sent frees it
    else
        delete reply;  // sent at once, or failed (the initiator sees its endpoint fail)
    return UCS_OK;
}

// Initiator: the answer to one write message.
ucs_status_t on_batch_ack(void* arg, const void* header, size_t header_length, void*, size_t,
                          const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (!usable(header, header_length, sizeof(BatchAck), param)) return UCS_OK;
    BatchAck ack;
    std::memcpy(&ack, header, sizeof(ack));
    XferRequest* r = nullptr;
    BatchMsg* m = e->pending_message(ack.token, ack.seq, r);
    if (!m) return UCS_OK;
    m->answered = true;
    --r->acks_pending;
    if (ack.status != 0) r->rejected = true;
    return UCS_OK;
}

// Initiator: the answer to one read message; scatter its bytes into the local ranges.
ucs_status_t on_get_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (!usable(header, header_length, sizeof(BatchAck), param)) return UCS_OK;
    BatchAck ack;
    std::memcpy(&ack, header, sizeof(ack));
    XferRequest* r = nullptr;
    BatchMsg* m = e->pending_message(ack.token, ack.seq, r);
    if (!m) return UCS_OK;
    m->answered = true;
    --r->acks_pending;
    size_t expect = 0;
    for (const ucp_dt_iov_t& v : m->iov) expect += v.length;
    if (ack.status != 0 || length != expect) {
        r->rejected = true;
        return UCS_OK;
    }
    const char* src = static_cast<const char*>(data);
    for (const ucp_dt_iov_t& v : m->iov) {
        std::memcpy(v.buffer, src, v.length);
        src += v.length;
    }
    return UCS_OK;
}

// The message `seq` of the request behind `token` if it still waits for its
// answer (r: that request). Tokens are request ids xor a random salt, so no
// other peer can guess one and answer in the target's place.
BatchMsg* Engine::pending_message(uint64_t token, uint32_t seq, XferRequest*& r) {
    auto it = requests_.find(token ^ token_salt_);
    if (it == requests_.end()) return nullptr;
    r = &it->second;
    if (r->done || r->acks_pending == 0 || seq >= r->batches.size() || r->batches[seq].answered) return nullptr;
    return &r->batches[seq];
}

// Sends the host-memory ops of a request as target-checked messages.
void Engine::post_batches(PeerConn& c, XferRequest& r, const std::vector<Op>& ops, uint64_t id, bool is_write) {
    r.batches = plan_batches(ops, id ^ token_salt_, is_write);
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
    p.datatype = is_write ? ucp_dt_make_iov() : ucp_dt_make_contig(1);
    for (BatchMsg& m : r.batches) {
        void* req = is_write
                        ? ucp_am_send_nbx(c.ep, kBatchAmId, &m.header, sizeof(m.header), m.iov.data(), m.iov.size(), &p)
                        : ucp_am_send_nbx(c.ep, kGetAmId, &m.header, sizeof(m.header), m.table.data(),
                                          m.table.size() * sizeof(BatchEntry), &p);
        if (UCS_PTR_IS_ERR(req)) {
            ucs_status_t st = UCS_PTR_STATUS(req);
            if (c.failed || is_peer_failure(st)) throw PeerDisconnected(ucs_error("ucp_am_send_nbx", st));
            throw Error(ucs_error("ucp_am_send_nbx", st));
        }
        if (req) ucp_request_free(req);  // completion is the answer, not the send
        ++r.acks_pending;
    }
}

}  // namespace kvxfer
