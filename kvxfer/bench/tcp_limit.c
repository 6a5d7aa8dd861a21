/* The TCP limit of `kvxfer bench transfer`: the best a plain TCP socket does on
 * loopback between two processes, in native code (no interpreter in the loop).
 *
 *   tcp_limit NBYTES ITERS WARMUP
 *
 * forks a sink process; the parent sends WARMUP + ITERS messages of NBYTES
 * (an 8-byte big-endian length, then the payload), the sink acknowledges each
 * with one byte after receiving all of it, and the parent prints the seconds of
 * each measured message (send start -> ack received), one per line. TCP_NODELAY
 * on both sides, page-aligned pre-faulted buffers. Exit status 0 on success;
 * every socket wait is bounded by a 60 s SO_RCVTIMEO/SO_SNDTIMEO.
 * Built on first use by kvxfer/bench/tcp_limit.py with the system C compiler.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void tune(int fd) {
    int one = 1;
    struct timeval tv = {60, 0};
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static void send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t k = send(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("send");
        p += k, n -= (size_t)k;
    }
}

static void recv_all(int fd, char *p, size_t n) {
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("recv");
        p += k, n -= (size_t)k;
    }
}

static char *buffer(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 1) != 0) die("posix_memalign");
    memset(p, 1, n);  /* fault every page in before anything is timed */
    return p;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sink(int port, size_t nbytes) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) die("connect");
    tune(fd);
    char *buf = buffer(nbytes);
    for (;;) {
        unsigned char hdr[8];
        recv_all(fd, (char *)hdr, 8);
        uint64_t len = 0;
        for (int i = 0; i < 8; ++i) len = len << 8 | hdr[i];
        if (len == 0) break;
        if (len > nbytes) die("message larger than announced");
        recv_all(fd, buf, len);
        send_all(fd, "k", 1);
    }
    close(fd);
    exit(0);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s NBYTES ITERS WARMUP\n", argv[0]);
        return 2;
    }
    size_t nbytes = strtoull(argv[1], NULL, 10);
    long iters = atol(argv[2]), warmup = atol(argv[3]);
    if (nbytes == 0 || iters <= 0 || warmup < 0) {
        fprintf(stderr, "NBYTES and ITERS must be positive\n");
        return 2;
    }
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &alen) != 0)
        die("listen");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        close(lfd);
        sink(ntohs(a.sin_port), nbytes);
    }
    struct timeval tv = {60, 0};
    setsockopt(lfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) die("accept");
    close(lfd);
    tune(fd);
    char *payload = buffer(nbytes);
    unsigned char hdr[8];
    for (int i = 0; i < 8; ++i) hdr[i] = (unsigned char)((uint64_t)nbytes >> (56 - 8 * i));
    double *samples = calloc((size_t)iters, sizeof *samples);
    if (!samples) die("calloc");
    for (long i = 0; i < warmup + iters; ++i) {
        char ack;
        double t0 = now();
        send_all(fd, (const char *)hdr, 8);
        send_all(fd, payload, nbytes);
        recv_all(fd, &ack, 1);
        if (i >= warmup) samples[i - warmup] = now() - t0;
    }
    memset(hdr, 0, sizeof hdr);
    send_all(fd, (const char *)hdr, 8);
    close(fd);
    int status = 0;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "sink process failed\n");
        return 1;
    }
    for (long i = 0; i < iters; ++i) printf("%.9f\n", samples[i]);
    return 0;
}
