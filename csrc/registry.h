// Memory registry: regions named by small ids over a few UCX mappings.
//
// A *mapping* is one ucp_mem_map of an address range (plus its packed rkey and
// optional mlock). A *region* is what callers name: an id, an address range and
// the mapping that covers it. Registering a range that an existing mapping of
// the same memory kind already covers makes a new region over that mapping
// (refcounted) and costs no UCX call. Region ids are never reused, so a stale id
// stays invalid after deregistration.
#pragma once
#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvxfer {

enum class MemKind : int { Host = 0, Cuda = 1 };

struct Mapping {
    uintptr_t addr = 0;
    size_t length = 0;
    MemKind kind = MemKind::Host;
    int device_id = 0;
    ucp_mem_h memh = nullptr;
    std::string rkey;  // packed remote key, sent to peers in metadata
    bool is_pinned = false;
    int refs = 0;
};

struct Region {
    uint64_t id = 0;
    uintptr_t addr = 0;
    size_t length = 0;
    bool is_cached = false;  // true when it reused an existing mapping
    std::shared_ptr<Mapping> mapping;
};

class Registry {
public:
    // hugepages: "advise", "collapse" or "off" (see prefer_huge_pages in registry.cpp)
    Registry(ucp_context_h context, std::string hugepages)
        : context_(context), hugepages_(std::move(hugepages)) {}
    ~Registry();
    Registry(const Registry&) = delete;
    Registry& operator=(const Registry&) = delete;

    // Throws std::invalid_argument for a null/empty/overflowing range,
    // RegistrationError when UCX refuses the memory.
    const Region& add(uintptr_t addr, size_t length, MemKind kind, int device_id, bool pin);
    // Throws std::invalid_argument for an unknown id.
    void remove(uint64_t id);
    // nullptr when the id is unknown or deregistered.
    const Region* find(uint64_t id) const {
        auto it = regions_.find(id);
        return it == regions_.end() ? nullptr : &it->second;
    }
    std::vector<const Region*> all() const;
    size_t num_mappings() const { return mappings_.size(); }
    void clear();

private:
    std::shared_ptr<Mapping> map_new(uintptr_t addr, size_t length, MemKind kind, int device_id,
                                     bool pin);
    void release(const std::shared_ptr<Mapping>& m);

    ucp_context_h context_;
    uint64_t next_id_ = 1;
    std::unordered_map<uint64_t, Region> regions_;
    std::vector<std::shared_ptr<Mapping>> mappings_;
    std::string hugepages_;
};

}  // namespace kvxfer
