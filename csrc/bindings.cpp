// The only file that talks to Python: the exports, plus what marshalling needs --
// argument checks on the way in (array shapes, kinds) and the dicts built on the
// way out. Each concept lives in its own translation unit and is bound here.
// C++ exceptions (kvxfer::Error subclasses, see errors.h) are translated to
// the kvxfer.errors classes of the same name here (the translator below).
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <system_error>

#include "checksum.h"
#include "copy.h"
#include "disk_io.h"
#include "errors.h"
#include "key_table.h"
#include "shared_mem.h"
#include "spin.h"
#include "stripe.h"
#include "ucx_engine.h"
#include "vm_copy.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "kvxfer native layer: CPU gather/scatter, memory registration, UCX engine";

    // ---- copy: CPU gather/scatter (owner: pack/unpack) ----
    {
        using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
        m.def(
            "copy_tiles",
            [](I64 plane_addr, I64 block_stride, I64 outer_stride, I64 ids, std::array<int64_t, 3> sizes,
               int64_t row_bytes, int64_t tile_bytes, uintptr_t wire, bool to_wire, int num_threads,
               bool streaming) {
                const int64_t planes = plane_addr.size();
                if (block_stride.size() != planes || outer_stride.size() != 3 * planes)
                    throw py::value_error("copy_tiles: plane table sizes disagree");
                if (row_bytes <= 0 || tile_bytes != sizes[0] * sizes[1] * sizes[2] * row_bytes)
                    throw py::value_error("copy_tiles: tile geometry is inconsistent");
                kvxfer::TileCopy job{plane_addr.data(), block_stride.data(), outer_stride.data(), planes,
                                     ids.data(), static_cast<int64_t>(ids.size()),
                                     {sizes[0], sizes[1], sizes[2]}, row_bytes, tile_bytes, wire, streaming};
                py::gil_scoped_release release;
                kvxfer::copy_tiles(job, to_wire, num_threads);
            },
            py::arg("plane_addr"), py::arg("block_stride"), py::arg("outer_stride"), py::arg("ids"),
            py::arg("sizes"), py::arg("row_bytes"), py::arg("tile_bytes"), py::arg("wire"), py::arg("to_wire"),
            py::arg("num_threads"), py::arg("streaming") = false,
            "Gather (to_wire) or scatter KV tiles by a validated plan; raw addresses, GIL released.");
        m.def(
            "memcpy_parallel",
            [](uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads) {
                if (nbytes < 0) throw py::value_error("memcpy_parallel: negative size");
                py::gil_scoped_release release;
                kvxfer::memcpy_parallel(dst, src, nbytes, num_threads);
            },
            py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
            "Contiguous memcpy split across threads (benchmark baseline); raw addresses, GIL released.");
        m.def("set_vm_copy_threads", &kvxfer::set_vm_copy_threads, py::arg("threads"),
              "An engine's copy_threads (0: none given) for the process's same-host copy pool; ValueError "
              "if it conflicts with the size already fixed (vm_copy.h).");
        m.def("vm_copy_threads", &kvxfer::vm_copy_threads,
              "Copying threads (the caller included) of the process's same-host copy pool.");
        m.def("vm_resolve_threads", &kvxfer::vm_resolve_threads, py::arg("requested"), py::arg("cores"),
              "Copying threads a copy_threads setting (0: the default) gives on `cores` cores (vm_copy.h's rule).");
        // The copy constants, so Python (bench's copy resources) reads them instead of copying them.
        m.attr("VM_DEFAULT_THREADS") = kvxfer::kVmDefaultThreads;
        m.attr("VM_MAX_THREADS") = kvxfer::kVmMaxThreads;
        m.attr("VM_SPLIT_BYTES") = kvxfer::kVmSplitBytes;
        m.attr("STREAM_BYTES") = kvxfer::kStreamBytes;
        m.attr("MAX_TCP_LANES") = kvxfer::kMaxTcpLanes;  // stripe.h; AgentConfig checks tcp_lanes against it
    }

    // ---- object checksums of the KV store (checksum.h) ----
    {
        using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
        m.def(
            "checksum_runs",
            [](I64 addr, I64 len) {
                if (addr.ndim() != 1 || len.ndim() != 1 || addr.size() != len.size())
                    throw py::value_error("checksum_runs: addr and len must be 1-d of one length");
                for (py::ssize_t i = 0; i < len.size(); ++i)
                    if (len.data()[i] < 0 || (len.data()[i] > 0 && addr.data()[i] <= 0))
                        throw py::value_error("checksum_runs: bad run");
                py::gil_scoped_release release;
                return kvxfer::checksum_runs(addr.data(), len.data(), addr.size());
            },
            py::arg("addr"), py::arg("len"),
            "XXH3-64 of the concatenated runs [addr[i], addr[i] + len[i]) (host memory the caller owns); GIL released.");
        m.def("warm_copy_pool", &kvxfer::warm_copy_pool, py::arg("us"), py::call_guard<py::gil_scoped_release>(),
              "Wake the same-host copy pool's parked helpers to wait spinning for up to us microseconds "
              "(a caller about to post a job).");
        m.def(
            "copy_checksum_objects",
            [](I64 hashed, I64 other, I64 len, I64 counts, bool into_hashed, int64_t split_bytes, bool hash) {
                const py::ssize_t n = len.size();
                if (hashed.ndim() != 1 || other.ndim() != 1 || len.ndim() != 1 || counts.ndim() != 1 ||
                    hashed.size() != n || other.size() != n)
                    throw py::value_error("copy_checksum_objects: hashed, other and len must be 1-d of one length");
                int64_t runs = 0;
                for (py::ssize_t i = 0; i < counts.size(); ++i) {
                    if (counts.data()[i] < 0) throw py::value_error("copy_checksum_objects: negative run count");
                    runs += counts.data()[i];
                }
                if (runs != n) throw py::value_error("copy_checksum_objects: run counts do not add up to the runs");
                for (py::ssize_t i = 0; i < n; ++i)
                    if (len.data()[i] < 0 || (len.data()[i] > 0 && (hashed.data()[i] <= 0 || other.data()[i] <= 0)))
                        throw py::value_error("copy_checksum_objects: bad run");
                std::vector<uint64_t> out(counts.size());
                {
                    py::gil_scoped_release release;
                    kvxfer::copy_checksum_objects(hashed.data(), other.data(), len.data(), counts.data(),
                                                  counts.size(), into_hashed, split_bytes, out.data(), hash);
                }
                return out;
            },
            py::arg("hashed"), py::arg("other"), py::arg("len"), py::arg("counts"), py::arg("into_hashed"),
            py::arg("split_bytes") = static_cast<int64_t>(kvxfer::kVmSplitBytes), py::arg("hash") = true,
            "Per object (counts[i] consecutive runs each): checksum_runs of its hashed runs, copying each run to "
            "(or, into_hashed, from) other[i] as it is hashed, so each byte is read once (host memory the caller "
            "owns and has bounds-checked); objects of split_bytes or more in all (0: never) spread over the "
            "same-host copy pool's threads; hash=False: the copies alone (each checksum 0); GIL released.");
    }

    // ---- shared-memory host allocations for same-host peers (shared_mem.h) ----
    {
        m.def("shared_alloc", &kvxfer::shared_alloc, py::arg("length"), py::call_guard<py::gil_scoped_release>(),
              "Zeroed, populated shared memory (sealed memfd) of >= length bytes -> address.");
        m.def("shared_free", &kvxfer::shared_free, py::arg("addr"), py::call_guard<py::gil_scoped_release>(),
              "Unmap an allocation of shared_alloc; False if addr is not one.");
        m.def("shared_lookup", [](uintptr_t addr, size_t length) {
                const kvxfer::ShmRef r = kvxfer::shared_lookup(addr, length);
                py::list pieces;
                for (const auto& p : r.pieces) pieces.append(py::make_tuple(p.fd, p.ino, p.size));
                return py::make_tuple(r.offset, pieces);
            }, py::arg("addr"), py::arg("length"),
            "-> (offset in the first, [(fd, inode, size), ...]) of the allocations covering the range "
            "back to back; no pieces if none.");
    }

    // ---- a store node's published key set (key_table.h) ----
    {
        auto key_view = [](const py::handle& key) {
            char* p = nullptr;
            Py_ssize_t n = 0;
            if (!PyBytes_Check(key.ptr()) || PyBytes_AsStringAndSize(key.ptr(), &p, &n) != 0)
                throw py::type_error("key table: keys must be bytes");
            return std::make_pair(reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(n));
        };
        m.def("keys_ok", [](const py::list& keys, size_t max_len) {
                for (const py::handle& k : keys) {
                    if (!PyBytes_CheckExact(k.ptr())) return false;
                    const Py_ssize_t n = PyBytes_GET_SIZE(k.ptr());
                    if (n < 1 || static_cast<size_t>(n) > max_len) return false;
                }
                return true;
            }, py::arg("keys"), py::arg("max_len"),
            "Whether every item is a bytes object of 1..max_len bytes (the store's key check, at C speed).");
        m.def("key_table_bytes", &kvxfer::key_table_bytes, py::arg("nbuckets"),
              "Bytes of a key table of nbuckets (a power of two) buckets, header included.");
        m.def("key_table_init", &kvxfer::key_table_init, py::arg("base"), py::arg("nbuckets"),
              "Zero a key table at base (key_table_bytes(nbuckets) bytes the caller owns) and start its heartbeat.");
        m.def("key_table_add", [=](uintptr_t base, uint64_t nbuckets, py::bytes key) {
                auto k = key_view(key);
                return kvxfer::key_table_add(base, nbuckets, k.first, k.second);
            }, py::arg("base"), py::arg("nbuckets"), py::arg("key"),
            "Publish a key (the one writer); False: its bucket was full (counted as overflow).");
        m.def("key_table_remove", [=](uintptr_t base, uint64_t nbuckets, py::bytes key) {
                auto k = key_view(key);
                kvxfer::key_table_remove(base, nbuckets, k.first, k.second);
            }, py::arg("base"), py::arg("nbuckets"), py::arg("key"), "Withdraw a published key (the one writer).");
        m.def("key_table_beat", &kvxfer::key_table_beat, py::arg("base"), py::arg("alive") = true,
              "Refresh the heartbeat (alive=False: mark the writer stopped).");
        m.def("key_table_age_ns", &kvxfer::key_table_age_ns, py::arg("base"), py::arg("nbuckets"),
              "Nanoseconds since the heartbeat; -1 if the writer stopped or this is no table of nbuckets.");
        m.def("key_table_hash", [=](py::bytes key) {
                auto k = key_view(key);
                return kvxfer::key_table_hash(k.first, k.second);
            }, py::arg("key"), "A key's 64-bit hash: its bucket (the low bits) and fingerprint.");
        m.def("key_table_find", [=](uintptr_t base, uint64_t nbuckets, const py::sequence& keys) {
                const size_t n = keys.size();
                std::vector<const uint8_t*> ptrs(n);
                std::vector<size_t> lens(n);
                std::vector<py::object> held(n);  // the items, alive while their bytes are read
                for (size_t i = 0; i < n; ++i) {
                    held[i] = keys[i];
                    auto k = key_view(held[i]);
                    ptrs[i] = k.first;
                    lens[i] = k.second;
                }
                std::string out(n, '\0');
                kvxfer::key_table_find(base, nbuckets, ptrs.data(), lens.data(), n,
                                       reinterpret_cast<uint8_t*>(out.data()));
                return py::bytes(out);
            }, py::arg("base"), py::arg("nbuckets"), py::arg("keys"),
            "Per key (a list or tuple of bytes) a byte: 1 present, 0 absent, 2 unknown (ask the node).");
    }

    // ---- the store's disk tier: one data file, a few I/O threads (disk_io.h; kvxfer/store/disk.py) ----
    {
        using kvxfer::DiskFile;
        py::class_<DiskFile>(m, "DiskFile", "A disk tier's data file and its I/O threads (see disk_io.h)")
            .def(py::init([](const std::string& path, uint64_t size, int threads, bool direct) {
                     try {
                         return std::make_unique<DiskFile>(path, size, threads, direct);
                     } catch (const std::system_error& e) {
                         PyErr_SetObject(PyExc_OSError,
                                         py::make_tuple(e.code().value(), std::string(e.what()), path).ptr());
                         throw py::error_already_set();
                     }
                 }),
                 py::arg("path"), py::arg("size"), py::arg("threads"), py::arg("direct"))
            .def_property_readonly("direct", &DiskFile::direct)
            .def_property_readonly("align", &DiskFile::align)
            .def_property_readonly("event_fd", &DiskFile::event_fd)
            .def_property_readonly("size", &DiskFile::size)
            .def_property_readonly("queued", &DiskFile::queued)
            .def_property_readonly("bytes_read", &DiskFile::bytes_read)
            .def_property_readonly("bytes_written", &DiskFile::bytes_written)
            .def_property_readonly("busy_read_ns", &DiskFile::busy_read_ns)
            .def_property_readonly("busy_write_ns", &DiskFile::busy_write_ns)
            .def("submit",
                 [](DiskFile& f, uint64_t id, int op, uint64_t offset, uintptr_t addr, uint64_t length,
                    uint64_t hash_len, bool sync) {
                     if (op != kvxfer::kDiskWrite && op != kvxfer::kDiskRead && op != kvxfer::kDiskSync)
                         throw py::value_error("DiskFile.submit: op must be 0 (write), 1 (read) or 2 (sync)");
                     f.submit(kvxfer::DiskJob{id, op, offset, addr, length, hash_len, sync});
                 },
                 py::arg("id"), py::arg("op"), py::arg("offset") = 0, py::arg("addr") = 0, py::arg("length") = 0,
                 py::arg("hash_len") = 0, py::arg("sync") = false)
            .def("drain",
                 [](DiskFile& f) {
                     py::list out;
                     for (const auto& d : f.drain()) out.append(py::make_tuple(d.id, d.err, d.crc, d.direct));
                     return out;
                 })
            .def("close", &DiskFile::close, py::arg("finish") = true, py::call_guard<py::gil_scoped_release>());
        m.attr("DISK_WRITE") = static_cast<int>(kvxfer::kDiskWrite);
        m.attr("DISK_READ") = static_cast<int>(kvxfer::kDiskRead);
        m.attr("DISK_SYNC") = static_cast<int>(kvxfer::kDiskSync);
    }

    // ---- bounded busy-polling for the control plane's latency path (spin.h) ----
    {
        m.def(
            "spin_readable",
            [](int fd, int64_t ns, int64_t contended_ns) {
                py::gil_scoped_release release;
                return kvxfer::spin_readable(fd, ns, contended_ns);
            },
            py::arg("fd"), py::arg("ns"), py::arg("contended_ns") = 0,
            "Busy-poll fd for readability for at most ns nanoseconds (GIL released, yields each round): "
            "1 readable, 0 time ran out, -1 a yield took over contended_ns (> 0; the CPU is contended).");
    }

    // ---- registration and transfer engine (owner: memory/transport) ----
    {
        // Native failures -> the kvxfer.errors classes of the same name.
        py::register_local_exception_translator([](std::exception_ptr p) {
            auto raise = [](const char* name, const char* what) {
                py::object cls = py::module_::import("kvxfer.errors").attr(name);
                PyErr_SetString(cls.ptr(), what);
            };
            try {
                if (p) std::rethrow_exception(p);
            } catch (const kvxfer::RegistrationError& e) {
                raise("RegistrationError", e.what());
            } catch (const kvxfer::InvalidDescriptor& e) {
                raise("InvalidDescriptor", e.what());
            } catch (const kvxfer::PeerDisconnected& e) {
                raise("PeerDisconnected", e.what());
            } catch (const kvxfer::TransferTimeout& e) {
                raise("TransferTimeout", e.what());
            } catch (const kvxfer::ProtocolError& e) {
                raise("ProtocolError", e.what());
            } catch (const kvxfer::Error& e) {
                raise("KVXferError", e.what());
            }
        });
        using kvxfer::Engine;
        using Descs = py::array_t<int64_t, py::array::c_style>;
        auto rows = [](const Descs& d) -> size_t {
            if (d.ndim() != 2 || d.shape(1) != 5) throw py::value_error("descriptors must be int64 [n, 5]");
            return static_cast<size_t>(d.shape(0));
        };
        auto region_tuple = [](const kvxfer::Region& r) {
            return py::make_tuple(r.id, r.addr, r.length, static_cast<int>(r.mapping->kind),
                                  r.mapping->device_id, r.mapping->is_pinned, r.is_cached);
        };
        py::class_<Engine>(m, "Engine", "UCP context+worker, memory registry and connections (see ucx_engine.h)")
            .def(py::init<bool, const std::map<std::string, std::string>&, const std::string&, size_t, size_t>(),
                 py::arg("allow_vm") = true, py::arg("ucx") = std::map<std::string, std::string>(),
                 py::arg("hugepages") = std::string("advise"), py::arg("tcp_lanes") = 1,
                 py::arg("vm_split_bytes") = kvxfer::kVmSplitBytes)
            .def_property_readonly("uid", &Engine::uid)
            .def_property_readonly("closed", &Engine::closed)
            .def_property_readonly("num_rejected", &Engine::num_rejected)
            .def_property_readonly("num_endpoints", &Engine::num_endpoints)
            .def("register", [=](Engine& e, uintptr_t addr, size_t length, int kind, int device_id, bool pin) {
                    if (kind != 0 && kind != 1) throw py::value_error("kind must be 0 (host) or 1 (cuda)");
                    return region_tuple(e.register_region(addr, length, static_cast<kvxfer::MemKind>(kind), device_id, pin));
                }, py::arg("addr"), py::arg("length"), py::arg("kind") = 0, py::arg("device_id") = 0, py::arg("pin") = true,
                "-> (id, addr, length, kind, device_id, is_pinned, is_cached)")
            .def("deregister", &Engine::deregister, py::arg("region_id"))
            .def("regions", [=](Engine& e) {
                    py::list out;
                    for (const auto& r : e.regions()) out.append(region_tuple(r));
                    return out;
                })
            .def("metadata", [](Engine& e) { return py::bytes(e.metadata()); })
            .def("connect", [](Engine& e, py::bytes meta, bool allow_vm) {
                    std::string s = meta;
                    py::gil_scoped_release nogil;
                    return e.connect(s, allow_vm);
                }, py::arg("metadata"), py::arg("allow_vm") = true)
            .def("conn_info", [](Engine& e, uint64_t id) {
                    const kvxfer::PeerConn& c = e.conn(id);
                    py::dict regions, shared_addrs;
                    size_t shared = 0;
                    for (const auto& kv : c.regions) {
                        regions[py::int_(kv.first)] = py::make_tuple(kv.second.addr, kv.second.length);
                        shared += kv.second.shm_addr != 0;
                        if (kv.second.shm_addr != 0) shared_addrs[py::int_(kv.first)] = kv.second.shm_addr;
                    }
                    py::dict d;
                    d["transport"] = c.transport;
                    d["peer_uid"] = c.peer.uid;
                    d["peer_pid"] = c.peer.pid;
                    d["peer_host"] = c.peer.hostname;
                    d["ucx_info"] = c.ucx_info;
                    d["lanes"] = c.lanes.size();
                    d["regions"] = regions;
                    d["shared_regions"] = shared;  // remote regions written with memcpy (vm path)
                    d["shared_addrs"] = shared_addrs;  // region id -> where it is mapped here
                    return d;
                }, py::arg("conn_id"))
            .def("disconnect", &Engine::disconnect, py::arg("conn_id"), py::call_guard<py::gil_scoped_release>())
            .def("post", [=](Engine& e, uint64_t conn, bool is_write, const Descs& d) {
                    const size_t n = rows(d);
                    const int64_t* p = d.data();
                    py::gil_scoped_release nogil;
                    return e.post(conn, is_write, p, n);
                }, py::arg("conn_id"), py::arg("is_write"), py::arg("descs"))
            .def("test", &Engine::test, py::arg("request_id"), py::call_guard<py::gil_scoped_release>())
            .def("wait", &Engine::wait, py::arg("request_id"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
            .def("progress", &Engine::progress, py::call_guard<py::gil_scoped_release>())
            .def_property_readonly("event_fd", &Engine::event_fd)
            .def("arm", &Engine::arm, py::call_guard<py::gil_scoped_release>())
            .def("serve_key_table", &Engine::serve_key_table, py::arg("base"), py::arg("nbuckets"),
                 "Answer peers' lookups from the key table at base (remote_lookup.cpp).")
            .def("post_lookup", [](Engine& e, uint64_t conn, const py::sequence& keys) {
                    const size_t n = keys.size();
                    std::vector<uint64_t> hashes(n);
                    for (size_t i = 0; i < n; ++i) {
                        py::object k = keys[i];
                        char* p = nullptr;
                        Py_ssize_t len = 0;
                        if (!PyBytes_Check(k.ptr()) || PyBytes_AsStringAndSize(k.ptr(), &p, &len) != 0)
                            throw py::type_error("lookup: keys must be bytes");
                        hashes[i] = kvxfer::key_table_hash(reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(len));
                    }
                    py::gil_scoped_release nogil;
                    return e.post_lookup(conn, hashes.data(), n);
                }, py::arg("conn_id"), py::arg("keys"),
                "Ask the peer about keys (bytes, 1..64 each); a request id for test/wait, then lookup_result.")
            .def("lookup_result", [](Engine& e, uint64_t id) { return py::bytes(e.lookup_result(id)); },
                 py::arg("request_id"), "Per key of a completed lookup a byte: 1 present, 0 absent, 2 unknown.")
            .def_property_readonly("num_lookups", &Engine::num_lookups)
            .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());
    }
}
