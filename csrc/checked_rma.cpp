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

bool is_rndv(const ucp_am_recv_param_t* param) { return param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV; }

std::vector<ucp_dt_iov_t> iov_of(const std::vector<BatchEntry>& table) {
    std::vector<ucp_dt_iov_t> iov;
    iov.reserve(table.size());
    for (const BatchEntry& t : table) iov.push_back({reinterpret_cast<void*>(t.raddr), t.length});
    return iov;
}

size_t iov_bytes(const std::vector<ucp_dt_iov_t>& iov) {
    size_t n = 0;
    for (const ucp_dt_iov_t& v : iov) n += v.length;
    return n;
}

}  // namespace

void on_get_reply_sent(void* request, ucs_status_t, void* user_data) {
    auto* reply = static_cast<GetReply*>(user_data);
    --reply->engine->replies_in_flight_;
    delete reply;
    ucp_request_free(request);
}

void on_landed(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* l = static_cast<Landing*>(user_data);
    l->engine->landed(*l, status);
    delete l;
    ucp_request_free(request);
}

// Receives a checked rendezvous message's data into `l->iov` (this process's
// memory); landed() runs once it is there (at once, or from on_landed).
void Engine::receive(void* desc, Landing* l) {
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.datatype = ucp_dt_make_iov();
    p.cb.recv_am = on_landed;
    p.user_data = l;
    void* req = ucp_am_recv_data_nbx(worker_, desc, l->iov.data(), l->iov.size(), &p);
    if (UCS_PTR_IS_PTR(req)) {
        ++landings_in_flight_;
        l->counted = true;
        return;
    }
    landed(*l, UCS_PTR_STATUS(req));  // NULL: done already (UCS_OK)
    delete l;
}

void Engine::landed(Landing& l, ucs_status_t status) {
    if (l.counted) --landings_in_flight_;
    if (l.reply_ep) {  // target: a write landed; a failed receive gets no answer (its endpoint failed)
        if (status == UCS_OK && !closing_) send_answer(l.reply_ep, kBatchAckAmId, l.ack);
        return;
    }
    // initiator: a read answer landed in local memory
    auto it = requests_.find(l.ack.token ^ token_salt_);
    if (it == requests_.end() || it->second.done || it->second.acks_pending == 0) return;
    --it->second.acks_pending;
    if (status != UCS_OK) it->second.status = status;
}

// Target: a write message. Check every entry, then copy (eager) or receive the
// data into the checked ranges (rendezvous), and answer.
ucs_status_t on_batch(void* arg, const void* header, size_t header_length, void* data, size_t length,
                      const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    // Without a reply endpoint or a header it is not ours: dropped (a rendezvous one unread).
    if (!header || header_length < sizeof(BatchHeader) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return UCS_OK;
    BatchHeader h;
    std::vector<BatchEntry> table;
    std::string why;
    if (is_rndv(param)) {
        why = check_rndv_batch(*e->registry_, header, header_length, length, h, table);
        if (why.empty()) {
            e->receive(data, new Landing{e, param->reply_ep, {h.token, h.seq, 0u}, iov_of(table)});
            return UCS_OK;
        }
        std::memcpy(&h, header, sizeof(h));  // refused: the data is dropped unread
    } else {
        std::memcpy(&h, header, sizeof(h));
        why = header_length == sizeof(h) ? apply_batch(*e->registry_, h, data, length) : "malformed header";
    }
    if (!why.empty()) ++e->num_rejected_;
    send_answer(param->reply_ep, kBatchAckAmId, {h.token, h.seq, why.empty() ? 0u : 1u});
    return UCS_OK;
}

// Target: a read request. Check every entry, then send the bytes straight from
// this process's memory (UCX gathers them through the iov; the request stays
// counted in replies_in_flight_ until UCX is done reading).
ucs_status_t on_get(void* arg, const void* header, size_t header_length, void* data, size_t length,
                    const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    if (header_length != sizeof(BatchHeader) || !header || is_rndv(param) ||
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
    auto* reply = new GetReply{e, {h.token, h.seq, 0u}, iov_of(table)};
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = (iov_bytes(reply->iov) >= kRndvMinBytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER) |
              UCP_AM_SEND_FLAG_COPY_HEADER;
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

// Initiator: the answer to message `ack.seq` of a request, if it still waits
// for it (r: that request); marks it answered. nullptr: not ours, dropped.
BatchMsg* Engine::take_answer(const void* header, size_t header_length, BatchAck& ack, XferRequest*& r) {
    if (header_length != sizeof(BatchAck) || !header) return nullptr;
    std::memcpy(&ack, header, sizeof(ack));
    BatchMsg* m = pending_message(ack.token, ack.seq, r);
    if (m) m->answered = true;
    return m;
}

// Initiator: the answer to one write message.
ucs_status_t on_batch_ack(void* arg, const void* header, size_t header_length, void*, size_t,
                          const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    BatchAck ack;
    XferRequest* r = nullptr;
    if (is_rndv(param) || !e->take_answer(header, header_length, ack, r)) return UCS_OK;
    --r->acks_pending;
    if (ack.status != 0) r->rejected = true;
    return UCS_OK;
}

// Initiator: the answer to one read message; its bytes go into the local
// ranges (copied from an eager message, received straight there by rendezvous).
ucs_status_t on_get_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param) {
    auto* e = static_cast<Engine*>(arg);
    BatchAck ack;
    XferRequest* r = nullptr;
    BatchMsg* m = e->take_answer(header, header_length, ack, r);
    if (!m) return UCS_OK;
    if (ack.status != 0 || length != iov_bytes(m->iov)) {
        --r->acks_pending;
        r->rejected = true;
        return UCS_OK;
    }
    if (is_rndv(param)) {  // acks_pending drops when the data landed (Engine::landed)
        e->receive(data, new Landing{e, nullptr, ack, m->iov});
        return UCS_OK;
    }
    --r->acks_pending;
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

// Sends the host-memory ops of a request as target-checked messages, striped
// over the connection's lanes by bytes (stripe.h); seq numbers run across lanes.
void Engine::post_batches(PeerConn& c, XferRequest& r, const std::vector<Op>& ops, uint64_t id, bool is_write) {
    size_t bytes = 0;
    for (const Op& op : ops)
        if (checked_by_target(op)) bytes += op.length;
    const size_t n = stripe_count(bytes, c.lanes.size());
    std::vector<size_t> lane_of;  // per message
    if (n == 1) {
        r.batches = plan_batches(ops, id ^ token_salt_, is_write, max_am_header_);
        lane_of.assign(r.batches.size(), 0);
    } else {
        const auto parts = stripe_ops(ops, n);
        for (size_t k = 0; k < n; ++k) {
            for (BatchMsg& m : plan_batches(parts[k], id ^ token_salt_, is_write, max_am_header_)) {
                m.header.seq = static_cast<uint32_t>(r.batches.size());
                r.batches.push_back(std::move(m));  // the table's buffer (an eager iov's first entry) moves along
                lane_of.push_back(k);
            }
        }
    }
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    std::vector<char> header;
    for (size_t k = 0; k < r.batches.size(); ++k) {
        BatchMsg& m = r.batches[k];
        ucp_ep_h ep = c.lanes[lane_of[k]];
        const void* hdr = &m.header;
        size_t hdr_len = sizeof(m.header);
        p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
        if (m.rndv) {  // header = BatchHeader + table (copied by UCX), data by rendezvous
            header.resize(rndv_header_bytes(m));
            std::memcpy(header.data(), &m.header, sizeof(m.header));
            std::memcpy(header.data() + sizeof(m.header), m.table.data(), header.size() - sizeof(m.header));
            hdr = header.data();
            hdr_len = header.size();
            p.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
        }
        p.datatype = is_write ? ucp_dt_make_iov() : ucp_dt_make_contig(1);
        void* req = is_write ? ucp_am_send_nbx(ep, kBatchAmId, hdr, hdr_len, m.iov.data(), m.iov.size(), &p)
                             : ucp_am_send_nbx(ep, kGetAmId, hdr, hdr_len, m.table.data(),
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
