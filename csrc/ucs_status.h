// Small helpers shared by the engine's translation units.
#pragma once
#include <ucp/api/ucp.h>

#include <string>

namespace kvxfer {

inline std::string ucs_error(const char* what, ucs_status_t st) {
    return std::string(what) + ": " + ucs_status_string(st);
}

inline bool is_peer_failure(ucs_status_t st) {
    return st == UCS_ERR_CONNECTION_RESET || st == UCS_ERR_ENDPOINT_TIMEOUT || st == UCS_ERR_UNREACHABLE ||
           st == UCS_ERR_CANCELED || st == UCS_ERR_REJECTED || st == UCS_ERR_NOT_CONNECTED ||
           st == UCS_ERR_IO_ERROR;
}

}  // namespace kvxfer
