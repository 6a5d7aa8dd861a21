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

// Spin until `fd` is readable (poll, zero timeout); true if it became readable.
bool spin_readable(int fd, int64_t ns);

}  // namespace kvxfer
