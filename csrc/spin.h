// Bounded busy-polling without the GIL, for the control plane's latency path.
//
// On a VM a thread woken from a blocking wait costs both sides tens of µs (an
// IPI, a halted vCPU resumed), and a Python thread that spins holds the GIL
// against the others. This loop spins in native code with the GIL released, for
// at most `ns` nanoseconds, yielding the CPU every round so a thread woken onto
// this CPU runs at once (the spinner never delays the work it waits for).
#pragma once
#include <cstdint>

namespace kvxfer {

// Spin until `fd` is readable (poll, zero timeout), at most `ns`: 1 if it became
// readable, 0 if the time ran out, -1 if a yield took longer than `contended_ns`
// (> 0): another task wanted this CPU, and a spinner that yields to it waits a whole
// time slice for the CPU back, so the caller should block instead (its wake-up then
// preempts). contended_ns <= 0: never give up early.
int spin_readable(int fd, int64_t ns, int64_t contended_ns);

}  // namespace kvxfer
