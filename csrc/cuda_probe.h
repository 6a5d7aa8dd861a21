// CUDA driver access through dlopen: the build needs no CUDA toolkit, and a
// machine without a GPU simply reports that CUDA memory cannot be registered.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvxfer {

// Empty string when [addr, addr+length) is device memory of `device_id`;
// otherwise the reason (no driver, host pointer, wrong device, ...).
std::string cuda_check_device_range(uintptr_t addr, size_t length, int device_id);

}  // namespace kvxfer
