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

int spin_readable(int fd, int64_t ns, int64_t contended_ns) {
    if (fd < 0) return 0;
    int64_t now = now_ns();
    const int64_t end = now + (ns > 0 ? ns : 0);
    struct pollfd p {};
    p.fd = fd;
    p.events = POLLIN;
    do {
        p.revents = 0;
        if (poll(&p, 1, 0) > 0) return 1;
        relax();
        const int64_t before = now_ns();
        sched_yield();
        now = now_ns();
        if (contended_ns > 0 && now - before > contended_ns) return -1;
    } while (now < end);
    return 0;
}

}  // namespace kvxfer
