#include "vm_copy.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "copy.h"
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

namespace {

[[noreturn]] void throw_vm_error(int err, pid_t pid, bool is_write) {
    if (err == ESRCH) throw PeerDisconnected("peer process " + std::to_string(pid) + " exited");
    if (err == EPERM)
        throw PeerDisconnected("no longer permitted to access peer process " + std::to_string(pid));
    if (err == EFAULT)
        throw InvalidDescriptor("peer memory is no longer mapped (region freed after it was advertised)");
    throw Error(std::string(is_write ? "process_vm_writev: " : "process_vm_readv: ") + std::strerror(err));
}

// Ops whose remote side is mapped here (shared memory) are plain copies; in batches
// far larger than the caches with streaming stores (copy.h).
void shm_copy_ops(const Op* ops, size_t n, bool is_write, bool streaming) {
    for (size_t i = 0; i < n; ++i) {
        char* local = reinterpret_cast<char*>(ops[i].laddr);
        char* remote = reinterpret_cast<char*>(ops[i].shm);
        const int64_t len = static_cast<int64_t>(ops[i].length);
        if (is_write)
            copy_bytes(remote, local, len, streaming);
        else
            copy_bytes(local, remote, len, streaming);
    }
    fence(streaming);
}

// Copies ops[0, n) with up to IOV_MAX ranges per system call.
void vm_syscall_ops(pid_t pid, const Op* ops, size_t n, bool is_write) {
    static thread_local std::vector<struct iovec> lv(IOV_MAX), rv(IOV_MAX);
    struct iovec* liov = lv.data();
    struct iovec* riov = rv.data();
    size_t next = 0;      // first op not fully copied
    size_t done_in = 0;   // bytes of ops[next] already copied
    while (next < n) {
        size_t k = 0;
        for (size_t i = next; i < n && k < static_cast<size_t>(IOV_MAX); ++i, ++k) {
            const size_t skip = i == next ? done_in : 0;
            liov[k] = {reinterpret_cast<void*>(ops[i].laddr + skip), ops[i].length - skip};
            riov[k] = {reinterpret_cast<void*>(ops[i].raddr + skip), ops[i].length - skip};
        }
        ssize_t got = is_write ? process_vm_writev(pid, liov, k, riov, k, 0)
                               : process_vm_readv(pid, liov, k, riov, k, 0);
        if (got < 0) {
            const int err = errno;
            if (err == EINTR) continue;
            throw_vm_error(err, pid, is_write);
        }
        if (got == 0) throw InvalidDescriptor("peer memory is not accessible (zero-byte transfer)");
        // Partial transfer: it stops at a range boundary or a fault; resume after the copied bytes.
        size_t adv = static_cast<size_t>(got);
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

// Runs of shared-memory ops and of the others, each the way it goes.
void vm_copy_ops(pid_t pid, const Op* ops, size_t n, bool is_write, bool streaming) {
    size_t i = 0;
    while (i < n) {
        size_t j = i + 1;
        while (j < n && (ops[j].shm != 0) == (ops[i].shm != 0)) ++j;
        if (ops[i].shm)
            shm_copy_ops(ops + i, j - i, is_write, streaming);
        else
            vm_syscall_ops(pid, ops + i, j - i, is_write);
        i = j;
    }
}

std::mutex g_threads_mu;
size_t g_threads = 0;  // the pool's copying threads, caller included; 0: not fixed yet

size_t num_cores() {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw ? hw : 1;
}

// The pool's size, fixed from here on (the default unless a setting came first).
size_t fix_vm_copy_threads() {
    std::lock_guard<std::mutex> g(g_threads_mu);
    if (!g_threads) g_threads = vm_resolve_threads(0, num_cores());
    return g_threads;
}

// A few copy threads shared by every engine of the process, started on first use
// and kept (parked on a condition variable) for the life of the process. One job
// at a time: a caller that finds the pool busy copies alone instead of queueing.
class CopyPool {
public:
    static CopyPool& instance() {
        // Intentionally leaked: helpers are parked, never joined at exit.
        static CopyPool* pool = new CopyPool(fix_vm_copy_threads() - 1);
        return *pool;
    }

    size_t helpers() const { return getpid() == owner_ ? threads_.size() : 0; }

    // Wakes parked helpers to wait for the next job spinning, for up to `us` microseconds:
    // a helper woken only when the job is posted may start it late (a guest vCPU that
    // went idle takes a while to come back), and the caller then copies most of it alone.
    void warm(int64_t us) {
        if (helpers() == 0 || us <= 0) return;
        {
            std::lock_guard<std::mutex> g(mu_);
            spin_until_ = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
            ++warmth_;
        }
        cv_.notify_all();
    }

    // Runs fn(0..parts-1), part 0 on the caller; false (nothing ran) if the pool is busy.
    bool run(size_t parts, const std::function<void(size_t)>& fn) {
        std::unique_lock<std::mutex> busy(job_mu_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        steer_helpers();
        {
            std::lock_guard<std::mutex> g(mu_);
            fn_ = &fn;
            parts_ = parts;
            next_part_ = 1;
            pending_ = parts - 1;
            ++generation_;
        }
        cv_.notify_all();
        fn(0);
        // Help with parts no helper has picked up yet, then wait for the rest.
        for (;;) {
            size_t part;
            {
                std::lock_guard<std::mutex> g(mu_);
                if (next_part_ >= parts_) break;
                part = next_part_++;
            }
            fn(part);
            std::lock_guard<std::mutex> g(mu_);
            --pending_;
        }
        std::unique_lock<std::mutex> g(mu_);
        done_cv_.wait(g, [&] { return pending_ == 0; });
        fn_ = nullptr;
        return true;
    }

private:
    explicit CopyPool(size_t n) : owner_(getpid()) {
        for (size_t i = 0; i < n; ++i) {
            try {
                threads_.emplace_back([this] { loop(); });
            } catch (...) {
                break;  // fewer helpers than asked for; still correct
            }
        }
        for (auto& t : threads_) {
            handles_.push_back(t.native_handle());
            pthread_setname_np(t.native_handle(), "kvxfer-copy");  // as top -H and py-spy show it
            t.detach();
        }
    }

    // Keeps the helpers off the CPU the caller runs on (while it has others). Woken on a
    // job, a parked helper may otherwise be queued behind the caller on its CPU, the
    // scheduler waking it where the caller runs, not on an idle vCPU of a guest (on a
    // 2-core VM, 2026-12-05: in most 16-object store puts one thread copied nearly
    // everything, the other starting after the caller or up to 2 ms late). Set again
    // only when the caller shows up on another CPU.
    void steer_helpers() {
        const int cpu = sched_getcpu();
        if (cpu < 0 || cpu == steered_from_) return;
        cpu_set_t allowed;
        if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed) ||
            CPU_COUNT(&allowed) < 2)
            return;
        CPU_CLR(cpu, &allowed);
        for (pthread_t h : handles_) pthread_setaffinity_np(h, sizeof(allowed), &allowed);
        steered_from_ = cpu;
    }

    void loop() {
        uint64_t seen = 0, warmed = 0;
        std::unique_lock<std::mutex> g(mu_);
        for (;;) {
            cv_.wait(g, [&] { return generation_ != seen || warmth_ != warmed; });
            if (generation_ == seen) {  // warmed: spin until a job comes or the time is up
                warmed = warmth_;
                const auto until = spin_until_;
                g.unlock();
                while (generation_.load(std::memory_order_acquire) == seen &&
                       std::chrono::steady_clock::now() < until)
                    std::this_thread::yield();
                g.lock();
                if (generation_ == seen) continue;
            }
            seen = generation_;
            while (fn_ && next_part_ < parts_) {
                const size_t part = next_part_++;
                const std::function<void(size_t)>* fn = fn_;
                g.unlock();
                (*fn)(part);  // never throws: the caller's fn catches
                g.lock();
                if (--pending_ == 0) done_cv_.notify_one();
            }
        }
    }

    pid_t owner_;  // a forked child has none of the helpers
    std::vector<std::thread> threads_;
    std::vector<pthread_t> handles_;
    int steered_from_ = -1;  // the caller's CPU the helpers were last kept off (job_mu_ held)
    std::mutex job_mu_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(size_t)>* fn_ = nullptr;
    size_t parts_ = 0, next_part_ = 0, pending_ = 0;
    std::atomic<uint64_t> generation_{0};  // read unlocked by a spinning helper
    uint64_t warmth_ = 0;
    std::chrono::steady_clock::time_point spin_until_{};
};

}  // namespace

size_t vm_resolve_threads(size_t requested, size_t cores) {
    const size_t want = requested ? requested : std::min<size_t>(cores ? cores : 1, kVmDefaultThreads);
    return std::min<size_t>(std::max<size_t>(want, 1), kVmMaxThreads);
}

size_t vm_copy_threads() {
    std::lock_guard<std::mutex> g(g_threads_mu);
    return g_threads ? g_threads : vm_resolve_threads(0, num_cores());
}

void set_vm_copy_threads(size_t threads) {
    if (!threads) return;
    const size_t want = vm_resolve_threads(threads, num_cores());
    std::lock_guard<std::mutex> g(g_threads_mu);
    if (!g_threads) {
        g_threads = want;
        return;
    }
    if (want != g_threads)
        throw std::invalid_argument("copy_threads=" + std::to_string(threads) + " (" + std::to_string(want) +
                                    " copying threads) conflicts with this process's same-host copy pool of " +
                                    std::to_string(g_threads) +
                                    ", fixed by an earlier agent or by its first use: the pool is shared by "
                                    "every agent of a process, so they must agree on copy_threads");
}

void warm_copy_pool(int64_t us) { CopyPool::instance().warm(us); }

bool run_on_copy_pool(size_t parts, const std::function<void(size_t)>& fn) {
    if (parts < 2) return false;
    CopyPool& pool = CopyPool::instance();
    return pool.helpers() > 0 && pool.run(parts, fn);
}

void vm_transfer(pid_t pid, const std::vector<Op>& ops, bool is_write, size_t split_bytes) {
    size_t total = 0;
    for (const Op& op : ops) total += op.length;
    const bool streaming = total >= static_cast<size_t>(kStreamBytes);
    size_t parts = 1;
    if (!ops.empty() && split_bytes > 0 && total >= split_bytes) {
        CopyPool& pool = CopyPool::instance();
        // More slices than threads, taken in turn: a helper that wakes late (or shares
        // its core with other work) takes fewer, and the caller is never left waiting
        // on a big slice. Slices of at least 1 MiB keep the per-slice cost negligible.
        const size_t threads = pool.helpers() + 1;
        parts = threads == 1 ? 1 : std::max(threads, std::min<size_t>(total >> 20, 8 * threads));
        if (parts > 1) {
            // Byte-balanced slices, cut at page boundaries (an op may be split between two threads).
            const size_t page = 4096;
            std::vector<std::vector<Op>> slices(parts);
            size_t part = 0, in_part = 0;
            size_t target = (total / parts + page - 1) / page * page;
            for (const Op& op0 : ops) {
                Op op = op0;
                while (op.length > 0) {
                    size_t room = part + 1 == parts ? op.length : target - in_part;
                    if (room == 0) {
                        ++part;
                        in_part = 0;
                        continue;
                    }
                    Op piece = op;
                    piece.length = std::min(room, op.length);
                    slices[part].push_back(piece);
                    in_part += piece.length;
                    op.laddr += piece.length;
                    op.raddr += piece.length;
                    if (op.shm) op.shm += piece.length;
                    op.length -= piece.length;
                }
            }
            std::vector<std::exception_ptr> errors(parts);
            std::function<void(size_t)> fn = [&](size_t i) {
                try {
                    vm_copy_ops(pid, slices[i].data(), slices[i].size(), is_write, streaming);
                } catch (...) {
                    errors[i] = std::current_exception();
                }
            };
            if (pool.run(parts, fn)) {
                for (auto& e : errors)
                    if (e) std::rethrow_exception(e);
                return;
            }
        }
    }
    vm_copy_ops(pid, ops.data(), ops.size(), is_write, streaming);
}

}  // namespace kvxfer
