#include "vm_copy.h"

#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "errors.h"

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

namespace kvxfer {

PeerProcess::PeerProcess(pid_t pid) : pid_(pid) {
#ifdef SYS_pidfd_open
    pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#endif
}

PeerProcess::~PeerProcess() {
    if (pidfd_ >= 0) close(pidfd_);
}

bool PeerProcess::alive() const {
    if (pid_ <= 0) return false;
    if (pidfd_ >= 0) {
        struct pollfd p = {pidfd_, POLLIN, 0};
        return poll(&p, 1, 0) == 0;  // a pidfd becomes readable when the process exits
    }
    return kill(pid_, 0) == 0 || errno == EPERM;
}

bool vm_probe(pid_t pid, uint64_t probe_addr, uint64_t probe_length, const std::string& token) {
    if (pid <= 0 || probe_addr == 0 || token.size() != kProbeTokenBytes ||
        probe_length < kProbeTokenBytes + 1)
        return false;
    char seen[kProbeTokenBytes];
    struct iovec l = {seen, sizeof(seen)};
    struct iovec r = {reinterpret_cast<void*>(probe_addr), sizeof(seen)};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != static_cast<ssize_t>(sizeof(seen))) return false;
    if (std::memcmp(seen, token.data(), sizeof(seen)) != 0) return false;
    char one = 1;
    l = {&one, 1};
    r = {reinterpret_cast<void*>(probe_addr + kProbeTokenBytes), 1};
    return process_vm_writev(pid, &l, 1, &r, 1, 0) == 1;
}

void vm_transfer(pid_t pid, const std::vector<Op>& ops, bool is_write) {
    static thread_local std::vector<struct iovec> liov, riov;
    liov.resize(IOV_MAX);
    riov.resize(IOV_MAX);
    size_t next = 0;      // first op not fully copied
    size_t done_in = 0;   // bytes of ops[next] already copied
    while (next < ops.size()) {
        size_t k = 0, want = 0;
        for (size_t i = next; i < ops.size() && k < static_cast<size_t>(IOV_MAX); ++i, ++k) {
            const size_t skip = i == next ? done_in : 0;
            liov[k] = {reinterpret_cast<void*>(ops[i].laddr + skip), ops[i].length - skip};
            riov[k] = {reinterpret_cast<void*>(ops[i].raddr + skip), ops[i].length - skip};
            want += ops[i].length - skip;
        }
        ssize_t got = is_write ? process_vm_writev(pid, liov.data(), k, riov.data(), k, 0)
                               : process_vm_readv(pid, liov.data(), k, riov.data(), k, 0);
        if (got < 0) {
            const int err = errno;
            if (err == EINTR) continue;
            if (err == ESRCH) throw PeerDisconnected("peer process " + std::to_string(pid) + " exited");
            if (err == EPERM)
                throw PeerDisconnected("no longer permitted to access peer process " + std::to_string(pid));
            if (err == EFAULT)
                throw InvalidDescriptor("peer memory is no longer mapped (region freed after it was advertised)");
            throw Error(std::string(is_write ? "process_vm_writev: " : "process_vm_readv: ") + std::strerror(err));
        }
        if (got == 0) throw InvalidDescriptor("peer memory is not accessible (zero-byte transfer)");
        // Partial transfer: it stops at a range boundary or a fault; resume after the copied bytes.
        size_t adv = static_cast<size_t>(got);
        (void)want;
        while (adv > 0) {
            const size_t rest = ops[next].length - done_in;
            if (adv >= rest) {
                adv -= rest;
                ++next;
                done_in = 0;
            } else {
                done_in += adv;
                adv = 0;
            }
        }
    }
}

void local_copy(const std::vector<Op>& ops) {
    for (const Op& op : ops)
        std::memcpy(reinterpret_cast<void*>(op.raddr), reinterpret_cast<const void*>(op.laddr), op.length);
}

}  // namespace kvxfer
