// Same-host fast path: one copy between two processes with process_vm_writev /
// process_vm_readv, up to IOV_MAX ranges per system call, no staging buffer.
//
// A peer is identified by pid *and* a random token it advertises in a probe
// area: vm_probe reads the token back (proving the pid is that very process,
// not a namesake in another container) and writes one scratch byte (proving
// the kernel permits writes). PeerProcess holds a pidfd so a dead peer is
// noticed before a reused pid could be written to.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "validate.h"

namespace kvxfer {

constexpr size_t kProbeTokenBytes = 16;
constexpr size_t kProbeBytes = 64;  // token, then scratch

class PeerProcess {
public:
    PeerProcess() = default;
    explicit PeerProcess(pid_t pid);
    ~PeerProcess();
    PeerProcess(const PeerProcess&) = delete;
    PeerProcess& operator=(const PeerProcess&) = delete;
    pid_t pid() const { return pid_; }
    bool alive() const;  // false once the process exited

private:
    pid_t pid_ = 0;
    int pidfd_ = -1;
};

// True when this process may read the token at probe_addr and write a scratch byte after it.
bool vm_probe(pid_t pid, uint64_t probe_addr, uint64_t probe_length, const std::string& token);

// A batch of at least split_bytes (the engine's: AgentConfig.vm_split_bytes, default
// kVmSplitBytes, 0: never) is split into byte-even slices (cut at page boundaries,
// >= 1 MiB, up to 8 per thread) taken in turn by the calling thread and a small
// persistent pool of copy threads (started on first use, parked between batches; a
// caller that finds the pool busy copies alone). Smaller batches stay on the calling
// thread.
//
// The pool is the process's, shared by every engine, so its size is one value per
// process (AgentConfig.copy_threads: copying threads including the caller, default
// min(cores, 2), at most kVmMaxThreads, 1 disables the pool). set_vm_copy_threads
// records an engine's setting: 0 (none given) accepts the pool as it is; the first
// engine that gives one fixes the size (the pool starting fixes the default); an engine
// whose setting resolves to another count gets std::invalid_argument, so two agents of
// one process never silently disagree.
constexpr size_t kVmDefaultThreads = 2;
constexpr size_t kVmMaxThreads = 4;
constexpr size_t kVmSplitBytes = size_t{4} << 20;
// Copying threads (the caller included) a setting of `requested` (0: the default) gives on `cores` cores.
size_t vm_resolve_threads(size_t requested, size_t cores);
size_t vm_copy_threads();  // the process pool's copying threads, the caller included
void set_vm_copy_threads(size_t threads);  // throws std::invalid_argument on a conflicting setting
// Runs fn(0..parts-1) on the calling thread and the pool's helpers, parts taken in turn
// (fn must not throw). False, with nothing run, when the pool has no helpers or another
// caller holds it: the caller then runs the parts itself.
bool run_on_copy_pool(size_t parts, const std::function<void(size_t)>& fn);
// Wakes the pool's parked helpers to wait spinning for up to `us` microseconds, so that a
// job posted within that time starts on every thread at once (a caller about to post one).
void warm_copy_pool(int64_t us);

// Copies every op (local laddr <-> remote raddr; an op with shm set is a memcpy
// with the peer's shared memory mapped at shm, see shared_mem.h). Throws PeerDisconnected
// (ESRCH, EPERM: the process is gone or no longer ours), InvalidDescriptor
// (EFAULT: the peer unmapped the memory it advertised).
void vm_transfer(pid_t pid, const std::vector<Op>& ops, bool is_write, size_t split_bytes);

}  // namespace kvxfer
