// See disk_io.h.
#include "disk_io.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <system_error>

#include "checksum.h"

namespace kvxfer {

namespace {

uint64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// The alignment direct I/O needs on this file: the file system's own where the kernel
// says it (statx STATX_DIOALIGN, Linux 6.1), else 4 KiB (what every file system takes).
uint32_t dio_align(int fd) {
    uint32_t align = 4096;
#if defined(STATX_DIOALIGN)
    struct statx stx {};
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
        stx.stx_dio_offset_align > 0) {
        uint32_t need = stx.stx_dio_offset_align;
        if (stx.stx_dio_mem_align > need) need = stx.stx_dio_mem_align;
        if (need > align) align = need;
    }
#else
    (void)fd;
#endif
    return align;
}

// The whole of [addr, addr + len) at `offset`, through short transfers and EINTR; 0 or an errno.
int move_all(int fd, bool write, uint64_t offset, uintptr_t addr, uint64_t len) {
    uint64_t done = 0;
    while (done < len) {
        char* p = reinterpret_cast<char*>(addr) + done;
        const ssize_t n = write ? ::pwrite(fd, p, len - done, static_cast<off_t>(offset + done))
                                : ::pread(fd, p, len - done, static_cast<off_t>(offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) {
            if (write) return EIO;
            // a read past the end of a sparse file's written data: zeros (the file is sized)
            std::fill(p, p + (len - done), 0);
            return 0;
        }
        done += static_cast<uint64_t>(n);
    }
    return 0;
}

}  // namespace

DiskFile::DiskFile(const std::string& path, uint64_t size, int threads, bool direct) : size_(size) {
    if (threads < 1 || threads > 64) throw std::invalid_argument("DiskFile: threads must be in 1..64");
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "open " + path);
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || (static_cast<uint64_t>(st.st_size) != size && ::ftruncate(fd_, size) != 0)) {
        const int e = errno;
        ::close(fd_);
        throw std::system_error(e, std::generic_category(), "size " + path);
    }
    if (direct) {
        direct_fd_ = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);  // EINVAL: the file system refuses
        if (direct_fd_ >= 0) align_ = dio_align(direct_fd_);
    }
    event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) {
        const int e = errno;
        ::close(fd_);
        if (direct_fd_ >= 0) ::close(direct_fd_);
        throw std::system_error(e, std::generic_category(), "eventfd");
    }
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

DiskFile::~DiskFile() { close(false); }

void DiskFile::submit(const DiskJob& job) {
    if (job.op != kDiskSync && (job.offset > size_ || job.length > size_ - job.offset))
        throw std::invalid_argument("DiskFile: a range outside the file");
    if (job.hash_len > job.length) throw std::invalid_argument("DiskFile: hash_len over the length");
    {
        std::lock_guard<std::mutex> g(mu_);
        if (stop_) throw std::invalid_argument("DiskFile: closed");
        (job.op == kDiskRead ? reads_ : writes_).push_back(job);
    }
    cv_.notify_one();
}

std::vector<DiskDone> DiskFile::drain() {
    uint64_t count;
    while (::read(event_fd_, &count, sizeof count) < 0 && errno == EINTR) {
    }
    std::vector<DiskDone> out;
    std::lock_guard<std::mutex> g(mu_);
    out.swap(done_);
    return out;
}

uint64_t DiskFile::queued() const {
    std::lock_guard<std::mutex> g(mu_);
    return reads_.size() + writes_.size() + running_;
}

void DiskFile::run() {
    for (;;) {
        DiskJob job;
        bool cancel = false;
        {
            std::unique_lock<std::mutex> g(mu_);
            cv_.wait(g, [this] { return stop_ || !reads_.empty() || !writes_.empty(); });
            if (reads_.empty() && writes_.empty()) return;  // stopping, nothing left
            std::deque<DiskJob>& q = reads_.empty() ? writes_ : reads_;
            job = q.front();
            q.pop_front();
            cancel = stop_ && !finish_;
            ++running_;
        }
        DiskDone d = cancel ? DiskDone{job.id, ECANCELED, 0, false} : execute(job);
        {
            std::lock_guard<std::mutex> g(mu_);
            --running_;
            done_.push_back(d);
        }
        const uint64_t one = 1;
        while (::write(event_fd_, &one, sizeof one) < 0 && errno == EINTR) {
        }
    }
}

DiskDone DiskFile::execute(const DiskJob& job) {
    DiskDone d{job.id, 0, 0, false};
    const uint64_t start = now_ns();
    if (job.op == kDiskSync) {
        d.err = ::fdatasync(fd_) == 0 ? 0 : errno;
        write_ns_ += now_ns() - start;
        return d;
    }
    const int64_t addr = static_cast<int64_t>(job.addr), hlen = static_cast<int64_t>(job.hash_len);
    const bool aligned = job.offset % align_ == 0 && job.length % align_ == 0 && job.addr % align_ == 0;
    d.direct = direct_fd_ >= 0 && aligned;
    const int fd = d.direct ? direct_fd_ : fd_;
    if (job.op == kDiskWrite) {
        if (job.hash_len) d.crc = checksum_runs(&addr, &hlen, 1);
        d.err = move_all(fd, true, job.offset, job.addr, job.length);
        if (d.err == 0 && job.sync && ::fdatasync(fd_) != 0) d.err = errno;
        if (d.err == 0) bytes_written_ += job.length;
        write_ns_ += now_ns() - start;
    } else {
        d.err = move_all(fd, false, job.offset, job.addr, job.length);
        if (d.err == 0 && job.hash_len) d.crc = checksum_runs(&addr, &hlen, 1);
        if (d.err == 0) bytes_read_ += job.length;
        read_ns_ += now_ns() - start;
    }
    return d;
}

void DiskFile::close(bool finish) {
    {
        std::lock_guard<std::mutex> g(mu_);
        if (closed_) return;
        closed_ = stop_ = true;
        finish_ = finish;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    if (direct_fd_ >= 0) ::close(direct_fd_);
    if (fd_ >= 0) ::close(fd_);
    if (event_fd_ >= 0) ::close(event_fd_);
    direct_fd_ = fd_ = event_fd_ = -1;
}

}  // namespace kvxfer
