# Type stub of the private extension kvxfer._C (load it through kvxfer._native.load()).
# Each owner of a csrc/bindings.cpp section keeps its part here.
import numpy as np
import numpy.typing as npt

# ---- copy: CPU gather/scatter (kvxfer/kernels/cpu.py validates every argument) ----
def copy_tiles(
    plane_addr: npt.NDArray[np.int64],
    block_stride: npt.NDArray[np.int64],
    outer_stride: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64],
    sizes: tuple[int, int, int],
    row_bytes: int,
    tile_bytes: int,
    wire: int,
    to_wire: bool,
    num_threads: int,
    streaming: bool = False,
) -> None: ...
def memcpy_parallel(dst: int, src: int, nbytes: int, num_threads: int) -> None: ...
def checksum_runs(addr: npt.ArrayLike, len: npt.ArrayLike) -> int: ...
def copy_checksum_objects(hashed: npt.ArrayLike, other: npt.ArrayLike, len: npt.ArrayLike, counts: npt.ArrayLike,
                          into_hashed: bool, split_bytes: int = ..., hash: bool = True) -> list[int]: ...  # per object: checksum of its hashed runs (spread over the vm copy pool from split_bytes, default VM_SPLIT_BYTES; 0: one thread); hash=False: the copies alone, each 0
def warm_copy_pool(us: int) -> None: ...  # wake the vm copy pool's helpers to wait spinning for up to us microseconds
def set_vm_copy_threads(threads: int) -> None: ...  # 0: none given; ValueError if the process pool has another size
def vm_copy_threads() -> int: ...  # the process pool's copying threads, the caller included
def vm_resolve_threads(requested: int, cores: int) -> int: ...  # threads a setting (0: default) gives
VM_DEFAULT_THREADS: int  # vm copy threads by default: min(cores, this)
VM_MAX_THREADS: int  # cap on the vm copy threads
VM_SPLIT_BYTES: int  # vm batches of at least this many bytes are split across the threads
STREAM_BYTES: int  # copies of at least this many bytes use non-temporal stores
MAX_TCP_LANES: int  # the most TCP lanes (endpoints) per peer
# ---- shared-memory host allocations (kvxfer/shared_memory.py wraps them) ----
def shared_alloc(length: int) -> int: ...  # zeroed, populated, sealed memfd memory; RegistrationError
def shared_free(addr: int) -> bool: ...  # False: not an address shared_alloc returned
def shared_lookup(addr: int, length: int) -> tuple[int, list[tuple[int, int, int]]]: ...  # offset, [(fd, inode, size)]: back to back
# ---- a store node's published key set (kvxfer/store/key_table.py wraps it) ----
def keys_ok(keys: list[bytes], max_len: int) -> bool: ...  # every item a bytes of 1..max_len bytes
def key_table_bytes(nbuckets: int) -> int: ...  # nbuckets: a power of two; ValueError otherwise
def key_table_init(base: int, nbuckets: int) -> None: ...  # zero it, start the heartbeat
def key_table_add(base: int, nbuckets: int, key: bytes) -> bool: ...  # the one writer; False: bucket full
def key_table_remove(base: int, nbuckets: int, key: bytes) -> None: ...  # the one writer
def key_table_beat(base: int, alive: bool = True) -> None: ...  # alive=False: readers stop at once
def key_table_age_ns(base: int, nbuckets: int) -> int: ...  # -1: stopped, or no table of nbuckets
def key_table_find(base: int, nbuckets: int, keys: list[bytes] | tuple[bytes, ...]) -> bytes: ...  # 1/0/2 per key
def spin_readable(fd: int, ns: int, contended_ns: int = 0) -> int: ...  # busy-poll fd up to ns (GIL released,
# yields): 1 readable, 0 time ran out, -1 a yield took over contended_ns (> 0): the CPU is contended

# ---- the store's disk tier (kvxfer/store/disk.py wraps it; csrc/disk_io.h) ----
DISK_WRITE: int
DISK_READ: int
DISK_SYNC: int

class DiskFile:
    """A data file (created, sized sparse) and I/O threads: O_DIRECT for aligned jobs, else buffered."""

    def __init__(self, path: str, size: int, threads: int, direct: bool) -> None: ...  # OSError(errno) if it cannot
    @property
    def direct(self) -> bool: ...  # O_DIRECT was taken
    @property
    def align(self) -> int: ...  # what direct I/O needs of offsets, lengths and addresses
    @property
    def event_fd(self) -> int: ...  # readable while completions wait
    @property
    def size(self) -> int: ...
    @property
    def queued(self) -> int: ...  # jobs queued or running
    @property
    def bytes_read(self) -> int: ...
    @property
    def bytes_written(self) -> int: ...
    @property
    def busy_read_ns(self) -> int: ...
    @property
    def busy_write_ns(self) -> int: ...
    def submit(self, id: int, op: int, offset: int = 0, addr: int = 0, length: int = 0, hash_len: int = 0,
               sync: bool = False) -> None: ...  # ValueError: a range outside the file, or closed
    def drain(self) -> list[tuple[int, int, int, bool]]: ...  # (id, errno or 0, XXH3-64 of the hashed bytes, direct)
    def close(self, finish: bool = True) -> None: ...  # run (finish) or cancel (ECANCELED) the queued jobs

# ---- registration and transfer engine (kvxfer/memory.py, kvxfer/transport/ucx.py wrap it) ----
# Errors: RegistrationError, InvalidDescriptor, PeerDisconnected, TransferTimeout,
# ProtocolError, KVXferError (kvxfer.errors); argument mistakes raise ValueError.
RegionTuple = tuple[int, int, int, int, int, bool, bool]  # id, addr, length, kind, device_id, is_pinned, is_cached

class Engine:
    """UCP context + worker, memory registry, connections. Explicit progress, no thread."""

    def __init__(self, allow_vm: bool = True, ucx: dict[str, str] = {}, hugepages: str = "advise",
                 tcp_lanes: int = 1, vm_split_bytes: int = ...) -> None: ...
    @property
    def uid(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def num_rejected(self) -> int: ...  # messages refused as a target (ranges outside our regions)
    @property
    def num_endpoints(self) -> int: ...  # endpoints opened by connect and not closed yet (all lanes)
    def register(self, addr: int, length: int, kind: int = 0, device_id: int = 0, pin: bool = True) -> RegionTuple: ...
    def deregister(self, region_id: int) -> None: ...
    def regions(self) -> list[RegionTuple]: ...
    def metadata(self) -> bytes: ...
    def connect(self, metadata: bytes, allow_vm: bool = True) -> int: ...
    def conn_info(self, conn_id: int) -> dict: ...  # transport, peer_uid, peer_pid, peer_host, ucx_info, lanes, failed, regions, shared_regions, shared_addrs
    def disconnect(self, conn_id: int) -> None: ...
    def post(self, conn_id: int, is_write: bool, descs: npt.NDArray[np.int64]) -> int: ...  # descs: int64 [n, 5]
    def test(self, request_id: int) -> bool: ...
    def wait(self, request_id: int, timeout: float) -> None: ...
    def progress(self) -> int: ...
    @property
    def event_fd(self) -> int: ...  # epoll fd of the UCX worker, -1 once closed
    def arm(self) -> bool: ...  # progress until idle, then arm event_fd; False: events pending
    def close(self) -> None: ...
