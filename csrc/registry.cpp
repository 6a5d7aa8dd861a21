#include "registry.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "cuda_probe.h"
#include "errors.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

namespace kvxfer {
namespace {

// Backs the 2 MiB-aligned interior of a host region with transparent huge pages,
// best effort. process_vm_writev pins the target's pages per range and walks both
// sides' page tables; on huge pages that costs ~1/512 as many entries (measured on a
// 2-core EPYC VM: 4.5-5.8 -> 8.1-8.8 GB/s for 32 KiB runs). Mode (AgentConfig.hugepages):
// "advise" (default: MADV_HUGEPAGE; pages first touched after it -- including by the
// mlock that pins the region -- are huge, pages already there stay as they are),
// "collapse" (also MADV_COLLAPSE: rebuilds the pages already there as huge pages,
// contents kept, once per mapping; costs ~2-4 ms per MiB at registration), "off".
void prefer_huge_pages(uintptr_t addr, size_t length, const std::string& m) {
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    if (m == "off") return;
    const uintptr_t lo = (addr + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t hi = (addr + length) & ~(kHuge - 1);
    if (hi <= lo) return;
    void* p = reinterpret_cast<void*>(lo);
    if (madvise(p, hi - lo, MADV_HUGEPAGE) != 0) return;  // THP unavailable: nothing to do
    if (m == "collapse") (void)madvise(p, hi - lo, MADV_COLLAPSE);  // may fail (fragmentation, old kernel)
}

}  // namespace

Registry::~Registry() { clear(); }

void Registry::clear() {
    regions_.clear();
    for (auto& m : mappings_) {
        m->refs = 0;
        if (m->is_pinned) munlock(reinterpret_cast<void*>(m->addr), m->length);
        if (m->memh) ucp_mem_unmap(context_, m->memh);
        m->memh = nullptr;
    }
    mappings_.clear();
}

const Region& Registry::add(uintptr_t addr, size_t length, MemKind kind, int device_id, bool pin) {
    if (addr == 0) throw std::invalid_argument("register: null address");
    if (length == 0) throw std::invalid_argument("register: zero length");
    if (addr + length < addr) throw std::invalid_argument("register: range overflows the address space");
    if (device_id < 0) throw std::invalid_argument("register: negative device id");

    std::shared_ptr<Mapping> mapping;
    for (auto& m : mappings_) {
        if (m->kind == kind && m->device_id == device_id && m->addr <= addr &&
            addr + length <= m->addr + m->length) {
            mapping = m;  // covered: a cache hit, no UCX call
            break;
        }
    }
    const bool is_cached = static_cast<bool>(mapping);
    if (!mapping) mapping = map_new(addr, length, kind, device_id, pin);
    mapping->refs += 1;
    Region r;
    r.id = next_id_++;
    r.addr = addr;
    r.length = length;
    r.is_cached = is_cached;
    r.mapping = mapping;
    return regions_.emplace(r.id, std::move(r)).first->second;
}

std::shared_ptr<Mapping> Registry::map_new(uintptr_t addr, size_t length, MemKind kind,
                                           int device_id, bool pin) {
    if (kind == MemKind::Cuda) {
        // Refuse host pointers and missing drivers before UCX sees the range.
        std::string why = cuda_check_device_range(addr, length, device_id);
        if (!why.empty()) throw RegistrationError("register cuda: " + why);
    }
    auto m = std::make_shared<Mapping>();
    m->addr = addr;
    m->length = length;
    m->kind = kind;
    m->device_id = device_id;

    if (kind == MemKind::Host) prefer_huge_pages(addr, length, hugepages_);  // before UCX or mlock see the pages

    ucp_mem_map_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.address = reinterpret_cast<void*>(addr);
    p.length = length;
    p.memory_type = kind == MemKind::Cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    ucs_status_t st = ucp_mem_map(context_, &p, &m->memh);
    if (st != UCS_OK)
        throw RegistrationError(std::string("ucp_mem_map failed: ") + ucs_status_string(st));

    void* buf = nullptr;
    size_t size = 0;
    st = ucp_rkey_pack(context_, m->memh, &buf, &size);
    if (st != UCS_OK) {
        ucp_mem_unmap(context_, m->memh);
        throw RegistrationError(std::string("ucp_rkey_pack failed: ") + ucs_status_string(st));
    }
    m->rkey.assign(static_cast<const char*>(buf), size);
    ucp_rkey_buffer_release(buf);

    // Pinning is best effort: RLIMIT_MEMLOCK (ENOMEM) or a missing capability
    // (EPERM) leaves the region registered but unpinned, reported by is_pinned.
    if (pin && kind == MemKind::Host)
        m->is_pinned = mlock(reinterpret_cast<void*>(addr), length) == 0;
    mappings_.push_back(m);
    return m;
}

void Registry::release(const std::shared_ptr<Mapping>& m) {
    if (--m->refs > 0) return;
    if (m->is_pinned) munlock(reinterpret_cast<void*>(m->addr), m->length);
    if (m->memh) ucp_mem_unmap(context_, m->memh);
    m->memh = nullptr;
    mappings_.erase(std::remove(mappings_.begin(), mappings_.end(), m), mappings_.end());
}

void Registry::remove(uint64_t id) {
    auto it = regions_.find(id);
    if (it == regions_.end())
        throw std::invalid_argument("deregister: region " + std::to_string(id) + " is not registered");
    std::shared_ptr<Mapping> m = it->second.mapping;
    regions_.erase(it);
    release(m);
}

std::vector<const Region*> Registry::all() const {
    std::vector<const Region*> out;
    out.reserve(regions_.size());
    for (auto& kv : regions_) out.push_back(&kv.second);
    std::sort(out.begin(), out.end(), [](auto a, auto b) { return a->id < b->id; });
    return out;
}

}  // namespace kvxfer
