#include "spin.h"

#include <poll.h>
#include <sched.h>

#include <chrono>

namespace kvxfer {
namespace {

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

}  // namespace

bool spin_readable(int fd, int64_t ns) {
    if (fd < 0) return false;
    const int64_t end = now_ns() + (ns > 0 ? ns : 0);
    struct pollfd p {};
    p.fd = fd;
    p.events = POLLIN;
    do {
        p.revents = 0;
        if (poll(&p, 1, 0) > 0) return true;
        relax();
        sched_yield();
    } while (now_ns() < end);
    return false;
}

}  // namespace kvxfer
