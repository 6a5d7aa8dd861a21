"""The disk tier's journal: a commit record for every object written to disk, a drop
record for every object that left it.

An object is on disk once all of its bytes are in the data file **and** its commit
record follows in the journal (appended only after the write completed). Recovery
replays the journal in order and keeps the objects committed and not dropped since;
bytes without their commit record (a node killed mid-write) are never named, so never
served. A chunk is reused only after the drop record of what it held was appended, so
a restart never pairs a record with another object's bytes (the reader's checksum is
the second line of defence, for a host that lost power with records not yet synced).

One record, little-endian::

    "KVJ1" | kind u8 | key_len u8 | fmt_len u8 | 0 u8 | offset u64 | nbytes u64 | dcrc u64 | meta_len u32
    key | fmt (ASCII) | meta (JSON: the checksum the object was committed with) | crc32 of all the above u32

``kind`` is :data:`COMMIT` or :data:`DROP` (``key`` and ``offset`` only: the chunk
freed). ``dcrc`` is XXH3-64 of the object's bytes, checked when they are read back.
Records are appended with one ``write`` each batch; a write that fails or comes up
short is cut off again (``ftruncate``), and replay stops at the first record that
does not check (the torn tail of a node killed mid-append). Recovery then rewrites
the journal with the live records only (a new file, synced, renamed over the old).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass

__all__ = ["Journal", "Record", "COMMIT", "DROP", "encode", "replay"]

COMMIT, DROP = 1, 2
MAGIC = b"KVJ1"
_HEAD = struct.Struct("<4sBBBBQQQI")
_TAIL = struct.Struct("<I")
MAX_META = 1 << 20


@dataclass(frozen=True)
class Record:
    kind: int
    key: bytes
    offset: int
    nbytes: int = 0
    dcrc: int = 0
    fmt: str = ""
    crc: object = 0  # the object's checksum as committed: an int, or [[lo, hi, crc], ...] for parts


def encode(rec: Record) -> bytes:
    fmt = rec.fmt.encode("ascii")
    meta = json.dumps(rec.crc, separators=(",", ":")).encode() if rec.kind == COMMIT else b""
    body = _HEAD.pack(MAGIC, rec.kind, len(rec.key), len(fmt), 0, rec.offset, rec.nbytes, rec.dcrc,
                      len(meta)) + rec.key + fmt + meta
    return body + _TAIL.pack(zlib.crc32(body))


def replay(path: str) -> tuple[list, int, bool]:
    """``(records, good_bytes, torn)``: the records of the journal at ``path`` in order, up
    to the first that does not check; ``good_bytes`` they span; ``torn``: bytes followed
    that are no whole record. A missing journal is an empty one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0, False
    out, pos, n = [], 0, len(data)
    while pos + _HEAD.size + _TAIL.size <= n:
        magic, kind, klen, flen, _, offset, nbytes, dcrc, mlen = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + klen + flen + mlen
        if magic != MAGIC or kind not in (COMMIT, DROP) or mlen > MAX_META or end + _TAIL.size > n:
            break
        if _TAIL.unpack_from(data, end)[0] != zlib.crc32(data[pos:end]):
            break
        at = pos + _HEAD.size
        key, fmt, meta = data[at:at + klen], data[at + klen:at + klen + flen], data[at + klen + flen:end]
        try:
            crc = json.loads(meta) if kind == COMMIT else 0
            out.append(Record(kind, key, offset, nbytes, dcrc, fmt.decode("ascii"), crc))
        except (ValueError, UnicodeDecodeError):
            break
        pos = end + _TAIL.size
    return out, pos, pos < n


class Journal:
    """The journal file at ``path``, opened for appending (created if absent)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self._fd).st_size

    def append(self, blob: bytes) -> None:
        """Append records (one ``write``); on an error (``OSError``: ENOSPC, EROFS, EIO, ...)
        or a short write, what was written of them is cut off again before it is raised."""
        try:
            n = os.write(self._fd, blob)
            if n != len(blob):
                raise OSError(28, "short write to the journal (disk full?)", self.path)
        except OSError:
            try:
                os.ftruncate(self._fd, self.size)
            except OSError:
                pass
            raise
        self.size += n

    def rewrite(self, blobs) -> None:
        """Replace the journal by ``blobs`` (the live records): a new file, synced, renamed
        over the old one, the directory synced."""
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = b"".join(blobs)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.size = len(data)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def vanished(self) -> bool:
        """The file was removed (or its directory) since it was opened."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
