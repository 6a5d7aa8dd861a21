// Shared-memory pools for same-host peers: host memory carved from a sealed
// memfd that a peer on the vm path maps once, at connect, and then writes or
// reads with plain memcpy (no process_vm_writev page walk per request).
//
// shared_alloc gives a process-private table entry {addr, length, memfd}; the
// engine advertises the memfds (number, inode, size; the region's offset in the
// first) with every region that such allocations cover back to back, only to
// authenticated peers, like an rkey. A peer opens /proc/<pid>/fd/<n> (the kernel allows it only where it
// would allow process_vm_writev: same user, ptrace access), checks the inode
// against the advertised one and that the file is a memfd sealed against
// shrinking (so no owner can truncate it under the mapping: no SIGBUS), and maps
// them back to back. Anything that does not check out leaves that region on process_vm_writev.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvxfer {

struct ShmPiece {
    int32_t fd = -1;   // the owner's fd number
    uint64_t ino = 0;  // inode of the memfd (checked by the peer after opening)
    uint64_t size = 0; // bytes in the memfd (the whole allocation)
};

// A range covered by one allocation or by several that lie back to back (engines
// allocate one pool tensor per layer; a layout may register them as one region).
struct ShmRef {
    std::vector<ShmPiece> pieces;  // empty: not shared memory
    uint64_t offset = 0;           // offset of the range's first byte in pieces[0]
};
constexpr size_t kMaxShmPieces = 4096;

// Allocates `length` bytes (rounded up to whole pages) of zeroed shared memory,
// populated; returns its address. Throws RegistrationError (memfd/mmap failed).
uintptr_t shared_alloc(size_t length);
// Unmaps an allocation of shared_alloc; false if `addr` is not one.
bool shared_free(uintptr_t addr);
// The allocations covering [addr, addr + length) back to back; no pieces if none.
ShmRef shared_lookup(uintptr_t addr, size_t length);

// One peer's memfds mapped into this process, unmapped with it.
class PeerSegments {
public:
    PeerSegments() = default;
    ~PeerSegments();
    PeerSegments(const PeerSegments&) = delete;
    PeerSegments& operator=(const PeerSegments&) = delete;
    // Local address of the range's first byte with the memfds of process pid mapped
    // back to back here as in the owner, provided [ref.offset, ref.offset + length)
    // lies inside them; 0 when one cannot be used (the caller keeps process_vm_writev).
    uintptr_t map(pid_t pid, const ShmRef& ref, uint64_t length);

private:
    std::vector<std::pair<void*, size_t>> maps_;  // one reservation per mapped range
};

}  // namespace kvxfer
