// The KV store's disk tier: one data file and a small pool of threads that read and
// write it with large aligned I/O (kvxfer/store/disk.py owns the file's layout).
//
// Each job moves one object's chunk between host memory and the file in one pread or
// pwrite of the whole chunk (a few KiB to a few MiB), retried through short transfers
// and EINTR. The file is opened twice: with O_DIRECT where the file system takes it
// (no page cache, the device's DMA straight into or out of the caller's memory), and
// buffered; a job goes direct when its file offset, length and address are all
// multiples of align() (the store's large chunks are 4 KiB-aligned in memory and on
// disk), else buffered, as does every job where O_DIRECT was refused at open.
//
// A job may also hash: a write computes XXH3-64 (checksum.h) of its first hash_len
// bytes before writing them, a read after reading them, and reports it. Reads are
// taken before writes and syncs (a get waits on a read; write-back does not hold
// anyone up). Completions are collected in order of finishing: drain() returns them,
// and the eventfd (event_fd(), non-blocking) is readable while some wait, so the
// node's I/O thread can select on it. Nothing here blocks the caller.
//
// The memory a queued or running job names must stay valid until its completion was
// drained (the caller pins it). close() runs the jobs queued (or cancels them:
// ECANCELED), joins the threads and closes the file; it is idempotent.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvxfer {

enum DiskOp : int { kDiskWrite = 0, kDiskRead = 1, kDiskSync = 2 };

struct DiskJob {
    uint64_t id;
    int op;            // DiskOp
    uint64_t offset;   // in the file
    uintptr_t addr;    // host memory
    uint64_t length;   // bytes moved
    uint64_t hash_len; // bytes of [addr, addr + hash_len) hashed (0: none)
    bool sync;         // a write: fdatasync the file once written
};

struct DiskDone {
    uint64_t id;
    int32_t err;   // 0, or the errno that failed the job (ENOSPC, EIO, EROFS, ECANCELED, ...)
    uint64_t crc;  // XXH3-64 of the hashed bytes (0 when none were hashed)
    bool direct;   // moved with O_DIRECT
};

class DiskFile {
public:
    // Opens (creating if absent) `path` and sizes it to `size` bytes (ftruncate: sparse;
    // an existing file keeps its bytes), then starts `threads` threads (1..64). `direct`:
    // try O_DIRECT. Throws std::system_error (errno) when the file cannot be opened.
    DiskFile(const std::string& path, uint64_t size, int threads, bool direct);
    ~DiskFile();
    DiskFile(const DiskFile&) = delete;
    DiskFile& operator=(const DiskFile&) = delete;

    bool direct() const { return direct_fd_ >= 0; }
    uint32_t align() const { return align_; }
    int event_fd() const { return event_fd_; }
    uint64_t size() const { return size_; }

    // Queue a job (never blocks). std::invalid_argument for a range outside the file or
    // a closed file.
    void submit(const DiskJob& job);
    std::vector<DiskDone> drain();  // completions since the last call (clears the eventfd)
    uint64_t queued() const;        // jobs queued or running
    // Totals: bytes moved and nanoseconds the threads spent in pread/pwrite/fdatasync.
    uint64_t bytes_read() const { return bytes_read_.load(); }
    uint64_t bytes_written() const { return bytes_written_.load(); }
    uint64_t busy_read_ns() const { return read_ns_.load(); }
    uint64_t busy_write_ns() const { return write_ns_.load(); }
    void close(bool finish);

private:
    void run();
    DiskDone execute(const DiskJob& job);

    int fd_ = -1, direct_fd_ = -1, event_fd_ = -1;
    uint32_t align_ = 4096;
    uint64_t size_ = 0;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<DiskJob> reads_, writes_;  // reads are taken first
    std::vector<DiskDone> done_;
    uint64_t running_ = 0;
    bool stop_ = false, finish_ = true, closed_ = false;
    std::vector<std::thread> threads_;
    std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, read_ns_{0}, write_ns_{0};
};

}  // namespace kvxfer
