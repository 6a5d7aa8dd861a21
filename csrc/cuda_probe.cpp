#include "cuda_probe.h"

#include <dlfcn.h>

#include <mutex>

namespace kvxfer {
namespace {

// Subset of cuda.h, stable driver ABI.
using CUresult = int;
using CUdeviceptr = unsigned long long;
constexpr int kAttrMemoryType = 2;       // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrDeviceOrdinal = 9;    // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr int kAttrRangeSize = 12;       // CU_POINTER_ATTRIBUTE_RANGE_SIZE
constexpr int kAttrRangeStart = 11;      // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE

struct Driver {
    CUresult (*init)(unsigned) = nullptr;
    CUresult (*pointer_get_attribute)(void*, int, CUdeviceptr) = nullptr;
    bool ok = false;
};

const Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) return;
        d.init = reinterpret_cast<CUresult (*)(unsigned)>(dlsym(h, "cuInit"));
        d.pointer_get_attribute = reinterpret_cast<CUresult (*)(void*, int, CUdeviceptr)>(
            dlsym(h, "cuPointerGetAttribute"));
        d.ok = d.init && d.pointer_get_attribute && d.init(0) == 0;
    });
    return d;
}

}  // namespace

std::string cuda_check_device_range(uintptr_t addr, size_t length, int device_id) {
    const Driver& d = driver();
    if (!d.ok) return "the CUDA driver (libcuda.so.1) is not available";
    unsigned mem_type = 0;
    if (d.pointer_get_attribute(&mem_type, kAttrMemoryType, addr) != 0 || mem_type != kMemoryTypeDevice)
        return "address is not CUDA device memory";
    int ordinal = -1;
    if (d.pointer_get_attribute(&ordinal, kAttrDeviceOrdinal, addr) == 0 && ordinal != device_id)
        return "memory belongs to device " + std::to_string(ordinal);
    CUdeviceptr start = 0;
    size_t size = 0;
    if (d.pointer_get_attribute(&start, kAttrRangeStart, addr) == 0 &&
        d.pointer_get_attribute(&size, kAttrRangeSize, addr) == 0 &&
        addr + length > start + size)
        return "range runs past the end of its CUDA allocation";
    return {};
}

}  // namespace kvxfer
