// Typed failures of the native layer. bindings.cpp maps each onto the class of
// the same name in kvxfer.errors; std::invalid_argument becomes ValueError.
#pragma once
#include <stdexcept>
#include <string>

namespace kvxfer {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};
struct RegistrationError : Error {
    using Error::Error;
};
struct InvalidDescriptor : Error {
    using Error::Error;
};
struct PeerDisconnected : Error {
    using Error::Error;
};
struct TransferTimeout : Error {
    using Error::Error;
};
struct ProtocolError : Error {
    using Error::Error;
};

}  // namespace kvxfer
