"""The store's disk tier: objects written back from DRAM and read back bitwise for every
engine layout and TP parts, a restart that keeps them, a node SIGKILLed mid-write that
never serves a torn object, a byte flipped on disk, a directory another node holds, one
removed under the node, a full and a read-only file system."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

import pytest
import torch

import kvxfer
from kvxfer.store.disk import DiskConfig
from kvxfer.store.journal import COMMIT, DROP, Journal, Record, encode, replay
from kvxfer.store.node import StoreNode
from store_cases import SECRET, block_bits, make_layout, start_node, stop_node
from waiting import until

SLOT = 128 << 10
BIG = 640  # head dim of 120 KiB objects: 4 KiB-aligned chunks, moved with O_DIRECT (the small ones buffered)


def disk_node(path, *, dram_objects: int = 16, disk_bytes: int = 8 << 20, queue_objects: int = 4, **kw):
    """A node in this process: DRAM of ``dram_objects`` largest objects, a disk tier at ``path``
    (gets wait for reads from disk as long as a loaded machine may need)."""
    return StoreNode("127.0.0.1:0", dram_objects * SLOT, secret=SECRET, slot_bytes=SLOT,
                     disk=DiskConfig(str(path), disk_bytes, queue_bytes=queue_objects * SLOT, promote_timeout_s=30.0),
                     **kw)


def _store(node, **kw):
    return kvxfer.KVStore(nodes=[node.address], secret=SECRET, timeout=60.0, **kw)


def _drained(node) -> bool:
    return node.stats()["writeback_queue"] == 0


def _settled(node) -> bool:
    """No write or read in flight and DRAM at its watermark (a trim that a write's end lets
    go on has run: the queue alone reads empty for a moment between the two)."""
    ix = node.index
    return (node.tiers.queued_objects == 0 and (node.tiers.disk is None or node.tiers.disk.jobs == 0)
            and ix.alloc.bytes_allocated - ix.held_bytes <= ix.watermark)


@pytest.mark.parametrize("head_dim", [8, 128, BIG])
def test_every_layout_and_tp_parts_round_trip_bitwise_through_the_disk_tier(tmp_path, head_dim):
    """Chains put from an NHD pool and, in parts, by the two ranks of a TP group; the node
    restarts (SIGTERM writes DRAM to disk), empty in DRAM: each chain comes back from disk
    into another layout (HND, blocks-first NHD, cross-rank), bitwise."""
    n = 6
    src = make_layout("2 N B H D", n, seed=1, head_dim=head_dim)
    chains = {name: kvxfer.block_keys(range(4 * n), 4, salt=b"tiers-%s-%d" % (name.encode(), head_dim))
              for name in ("hnd", "nhd", "tp_reader", "parts")}
    node = disk_node(tmp_path, dram_objects=32)  # all in DRAM until the shutdown writes them
    try:
        with _store(node) as st, _store(node) as rank1:
            for name in ("hnd", "nhd", "tp_reader"):
                st.put(chains[name], src, range(n)).wait(timeout=60)
            ranks = [make_layout("N 2 B H D", n, tp_rank=r, tp_size=2, head_dim=head_dim) for r in range(2)]
            for r, rank in enumerate(ranks):  # each rank holds its heads of src's blocks
                for b in range(n):
                    lo, hi = rank.head_range
                    for layer in range(rank.num_layers):
                        for kv in range(2):
                            rank.kv_view(layer, kv)[b].copy_(src.kv_view(layer, kv)[b][:, lo:hi])
            hs = [c.put(chains["parts"], ranks[r], range(n)) for r, c in enumerate((st, rank1))]
            for h in hs:
                h.wait(timeout=60)
            assert st.lookup(chains["parts"]) == n
    finally:
        node.close()  # writes DRAM's objects to disk
    node = disk_node(tmp_path, dram_objects=32)
    try:
        s = node.stats()
        assert s["disk_state"] == "ok" and s["dram_objects"] == 0 and s["disk_recovered"] == 4 * n
        assert s["disk_direct"] is True
        with _store(node) as st:
            assert st.lookup(chains["hnd"]) == n  # lookups see the disk tier
            for name, dims in (("hnd", "N 2 H B D"), ("nhd", "N 2 B H D"), ("parts", "2 N B H D")):
                dst = make_layout(dims, n, head_dim=head_dim)
                h = st.get(chains[name], dst, range(n - 1, -1, -1))
                h.wait(timeout=60)
                assert h.result.from_disk == n and h.result.loaded == n
                for b in range(n):
                    assert torch.equal(block_bits(src, b), block_bits(dst, n - 1 - b)), (name, b)
            for r in range(2):  # a TP rank reads its heads (the first from disk, the second from DRAM)
                part = make_layout("N 2 B H D", n, tp_rank=r, tp_size=2, head_dim=head_dim)
                h = st.get(chains["tp_reader"], part, range(n))
                h.wait(timeout=60)
                assert h.result.from_disk == (n if r == 0 else 0)
                lo, hi = part.head_range
                for b in range(n):
                    assert torch.equal(block_bits(src, b)[:, :, :, lo:hi], block_bits(part, b))
            s = node.stats()
            assert s["disk_hits"] == 4 * n and s["disk_bad_objects"] == 0 and s["disk_objects"] == 0
    finally:
        node.close()


def test_evicted_objects_are_written_back_and_read_back_while_running(tmp_path):
    """A DRAM of 16 objects and 48 put: the evicted go to disk (none dropped while the
    write-back queue drains between puts), lookups and gets see all 48, and a get of
    objects on disk reads them back (then they are DRAM's: the tiers are exclusive)."""
    src = make_layout("2 N B H D", 48, seed=2, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 48), 4, salt=b"write-back")
    with disk_node(tmp_path) as node, _store(node) as st:
        for i in range(0, 48, 4):
            st.put(keys[i:i + 4], src, range(i, i + 4)).wait(timeout=60)
            until(lambda: _drained(node), "write-back drained", timeout=30, interval=0.01)
        s = node.stats()
        assert s["writeback_drops"] == 0 and s["dram_objects"] + s["disk_objects"] == 48
        assert s["writeback_objects"] == s["disk_objects"] > 16 and s["disk_bytes_used"] == s["disk_objects"] * 122880
        assert st.lookup(keys) == 48
        dst = make_layout("N 2 H B D", 48, head_dim=BIG)
        for i in range(0, 48, 8):
            h = st.get(keys[i:i + 8], dst, range(i, i + 8))
            h.wait(timeout=60)
            until(lambda: _settled(node), "write-back settled", timeout=30, interval=0.01)
        for b in range(48):
            assert torch.equal(block_bits(src, b), block_bits(dst, b))
        s = node.stats()
        assert s["disk_hits"] > 0 and s["disk_hits"] == s["disk_promotions"] and s["disk_bad_objects"] == 0
        pool = st.stats()
        assert pool["client"]["get_disk_objects"] == s["disk_hits"] == pool["disk_hits"]
        assert pool["dram_hits"] == s["dram_hits"] and pool["writeback_objects"] == s["writeback_objects"]
        metrics = _scrape(node)  # the node's Prometheus metrics, per tier
        assert metrics[("kvxfer_store_tier_hits_total", "disk")] == s["disk_hits"]
        assert metrics[("kvxfer_store_tier_hits_total", "dram")] == s["dram_hits"]
        assert metrics[("kvxfer_store_tier_evictions_total", "dram")] == s["dram_evictions"] > 0
        assert metrics[("kvxfer_store_tier_objects", "disk")] == s["disk_objects"]
        assert metrics[("kvxfer_store_tier_capacity_bytes", "disk")] == s["disk_capacity_bytes"] > 0
        assert metrics[("kvxfer_store_writeback_objects_total", None)] == s["writeback_objects"]
        assert metrics[("kvxfer_store_writeback_drops_total", None)] == 0
        assert metrics[("kvxfer_store_disk_up", None)] == 1


def _scrape(node) -> dict:
    """``{(name, tier label or None): value}`` of the node's kvxfer_store_* samples."""
    import re

    import httpx

    from kvxfer.store.metrics import serve_metrics

    server, port = serve_metrics(node, "127.0.0.1:0")
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text
    finally:
        server.shutdown()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(kvxfer_store_\w+)\{node="[^"]*"(?:,tier="(\w+)")?\} (\S+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def test_a_flipped_byte_on_disk_is_a_miss_and_the_object_is_dropped(tmp_path):
    """One byte of each of two objects on disk flipped (a small one, read buffered, and a
    large one, read with O_DIRECT): each is a miss (the read-back check fails), dropped
    from the tier and counted; its neighbours load bitwise."""
    small = make_layout("2 N B H D", 4, seed=3)
    big = make_layout("2 N B H D", 4, seed=4, head_dim=BIG)
    ks = kvxfer.block_keys(range(16), 4, salt=b"flip-small")
    kb = kvxfer.block_keys(range(16), 4, salt=b"flip-big")
    with disk_node(tmp_path) as node, _store(node) as st:
        st.put(ks, small, range(4)).wait(timeout=60)
        st.put(kb, big, range(4)).wait(timeout=60)
    with disk_node(tmp_path) as node, _store(node) as st:
        fd = os.open(tmp_path / "objects.dat", os.O_RDWR)
        try:
            for key in (ks[2], kb[2]):
                at = node.tiers.disk.peek(key).offset + 77
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x20]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        for keys, layout in ((ks, small), (kb, big)):
            dst = make_layout("N 2 B H D", 4, head_dim=layout.head_dim)
            h = st.get(keys, dst, range(4))
            with pytest.raises(kvxfer.StoreMiss) as err:
                h.wait(timeout=60)
            assert err.value.loaded == 2 and h.result.loaded == 3 and h.result.misses == 1
            for b in (0, 1, 3):
                assert torch.equal(block_bits(layout, b), block_bits(dst, b))
            assert st.lookup(keys) == 2  # dropped: a miss from now on
        s = node.stats()
        assert s["disk_bad_objects"] == 2 and st.stats()["client"]["checksum_failures"] == 0  # caught at the node


def test_a_second_node_is_refused_the_directory_and_serves_dram(tmp_path):
    src = make_layout("2 N B H D", 4, seed=5)
    keys = kvxfer.block_keys(range(16), 4, salt=b"lock")
    with disk_node(tmp_path) as first:
        with disk_node(tmp_path) as second, _store(second) as st:
            s = second.stats()
            assert s["disk_state"] == "unavailable" and "in use by another store node" in s["disk_error"]
            assert f"pid {os.getpid()}" in s["disk_error"]
            st.put(keys, src, range(4)).wait(timeout=60)  # DRAM serves
            dst = make_layout("N 2 H B D", 4)
            st.get(keys, dst, range(4)).wait(timeout=60)
            assert torch.equal(block_bits(src, 3), block_bits(dst, 3))
        assert first.stats()["disk_state"] == "ok"
    with disk_node(tmp_path) as third:  # the first one let go: the directory is free again
        assert third.stats()["disk_state"] == "ok"


def test_a_directory_removed_under_the_node_empties_the_tier_and_dram_serves(tmp_path):
    src = make_layout("2 N B H D", 40, seed=6, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 40), 4, salt=b"vanish")
    tier = tmp_path / "tier"
    with disk_node(tier) as node, _store(node) as st:
        for i in range(0, 40, 4):
            st.put(keys[i:i + 4], src, range(i, i + 4)).wait(timeout=60)
            until(lambda: _settled(node), "write-back drained", timeout=30, interval=0.01)
        assert st.lookup(keys) == 40 and node.stats()["disk_objects"] > 0
        shutil.rmtree(tier)
        until(lambda: node.stats()["disk_state"] == "vanished", "the tier noticed", timeout=30)
        until(lambda: _settled(node), "writes in flight ended", timeout=30, interval=0.01)
        s = node.stats()
        assert s["disk_objects"] == 0 and st.lookup(keys) == 0  # the oldest were on disk
        in_dram = [i for i, k in enumerate(keys) if node.index.contains(k)]
        assert in_dram
        dst = make_layout("N 2 B H D", 40, head_dim=BIG)
        st.get([keys[i] for i in in_dram], dst, in_dram).wait(timeout=60)
        for i in in_dram:
            assert torch.equal(block_bits(src, i), block_bits(dst, i))
        fresh = kvxfer.block_keys(range(8), 4, salt=b"after-vanish")
        st.put(fresh, src, [0, 1]).wait(timeout=60)  # puts go on (evictions are dropped now)
        assert st.lookup(fresh) == 2


def test_sigkill_mid_write_back_then_restart_serves_only_whole_objects(tmp_path):
    """A node process in heavy write-back (a DRAM of 32 objects, 600 put): SIGKILL while
    writes are in flight. Restarted on the same directory, it serves exactly the objects
    whose commit records were written, every one bitwise, none failing its check (a node
    that recorded objects before their bytes were written would serve torn ones here:
    write-back runs behind the puts, so writes are queued and in flight at the kill)."""
    n = 600
    src = make_layout("2 N B H D", 32, seed=7, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * n), 4, salt=b"sigkill")
    disk = ["--disk", str(tmp_path), "--disk-capacity", "256M", "--writeback-queue", "1M", "--disk-get-wait", "30"]
    proc, addr = start_node(capacity="4M", slot="128K", extra=disk)
    put_done = threading.Event()
    killed = threading.Event()

    def putter():
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, retry_s=60.0, timeout=60.0) as st:
            for i in range(0, n, 8):
                if killed.is_set():
                    break
                try:
                    st.put(keys[i:i + 8], src, [(i + j) % 32 for j in range(8)]).wait(timeout=60)
                except kvxfer.KVXferError:
                    break
                if i >= n // 2:
                    put_done.set()
        put_done.set()

    t = threading.Thread(target=putter)
    t.start()
    try:
        assert put_done.wait(120)
        os.killpg(proc.pid, signal.SIGKILL)
        killed.set()
        proc.wait(timeout=30)
        t.join(120)
    finally:
        stop_node(proc, signal.SIGKILL)
    proc, addr = start_node(capacity="4M", slot="128K", extra=disk)
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, timeout=60.0) as st:
            s = st.stats()
            recovered = [i for i, k in enumerate(keys) if st.lookup([k]) == 1]
            assert s["disk_recovered"] == len(recovered) > 0 and s["dram_objects"] == 0
            dst = make_layout("N 2 H B D", 8, head_dim=BIG)
            for c in range(0, len(recovered), 8):
                batch = recovered[c:c + 8]
                h = st.get([keys[i] for i in batch], dst, range(len(batch)))
                h.wait(timeout=60)  # a torn object would fail its check: a StoreMiss here
                for j, i in enumerate(batch):
                    assert torch.equal(block_bits(src, i % 32), block_bits(dst, j)), i
            s = st.stats()
            assert s["disk_bad_objects"] == 0 and s["client"]["checksum_failures"] == 0
            assert s["disk_hits"] == len(recovered)
    finally:
        stop_node(proc, signal.SIGKILL)


def _in_small_tmpfs(mount_dir, size: str, *, read_only: bool = False):
    """A ``wrap`` for start_node: the node runs in a mount namespace where ``mount_dir`` is
    a tmpfs of ``size`` (``read_only``: remounted read-only, with a ``tier`` directory
    made first). Skips the test where no mount namespace can be had."""
    probe = ["unshare", "-m", "true"] if os.geteuid() == 0 else ["unshare", "-Urm", "true"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare)")
    script = f'mount -t tmpfs -o size={size} tmpfs "{mount_dir}" || exit 97\n'
    if read_only:
        script += f'mkdir "{mount_dir}/tier" && mount -o remount,ro "{mount_dir}" || exit 98\n'
    script += 'exec "$@"\n'
    return lambda cmd: [*probe[:-1], "sh", "-c", script, "sh", *cmd]


def test_a_full_file_system_drops_and_counts_and_the_node_keeps_serving(tmp_path):
    """The disk tier on a 2 MiB tmpfs asked for 32 MiB: writes past what fits fail (ENOSPC),
    those objects are dropped and counted (logged), and the node serves DRAM and what fit."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = open(tmp_path / "node.log", "w+")
    disk = ["--disk", str(mnt / "tier"), "--disk-capacity", "32M", "--writeback-queue", "512K", "--disk-get-wait", "30"]
    proc, addr = start_node(capacity="4M", slot="128K", extra=disk, wrap=_in_small_tmpfs(mnt, "2m"), stderr=log)
    src = make_layout("2 N B H D", 32, seed=8, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 64), 4, salt=b"full")
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, timeout=60.0) as st:
            assert st.stats()["per_node"][addr]["disk_state"] == "ok"
            for i in range(0, 64, 4):
                st.put(keys[i:i + 4], src, [(i + j) % 32 for j in range(4)]).wait(timeout=60)
                until(lambda: st.stats()["writeback_queue"] == 0, "write-back drained", timeout=30, interval=0.02)
            s = st.stats()["per_node"][addr]
            assert s["disk_full_drops"] > 0 and s["disk_state"] == "ok" and 0 < s["disk_objects"] < 32
            dst = make_layout("N 2 B H D", 4, head_dim=BIG)
            st.get(keys[60:64], dst, range(4)).wait(timeout=60)  # the newest, in DRAM
            assert all(torch.equal(block_bits(src, (60 + j) % 32), block_bits(dst, j)) for j in range(4))
            from_disk = 0
            for i in [i for i in range(64) if st.lookup(keys[i:i + 1]) == 1]:  # oldest first: on disk
                h = st.get(keys[i:i + 1], dst, [0])
                try:
                    h.wait(timeout=60)
                except kvxfer.StoreMiss:  # evicted by the promotions before it (its write-back failed)
                    continue
                assert torch.equal(block_bits(src, i % 32), block_bits(dst, 0)), i
                from_disk += h.result.from_disk
                if from_disk:
                    break
            assert from_disk == 1 and st.stats()["disk_hits"] >= 1
    finally:
        stop_node(proc, signal.SIGKILL)
        log.seek(0)
        text = log.read()
        log.close()
    assert "the file system is full" in text


def test_a_read_only_directory_leaves_the_node_serving_dram(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    disk = ["--disk", str(mnt / "tier"), "--disk-capacity", "32M"]
    proc, addr = start_node(capacity="4M", slot="128K", extra=disk, wrap=_in_small_tmpfs(mnt, "2m", read_only=True))
    src = make_layout("2 N B H D", 8, seed=9, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 8), 4, salt=b"read-only")
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, timeout=60.0) as st:
            s = st.stats()["per_node"][addr]
            assert s["disk_state"] == "unavailable" and "Read-only file system" in s["disk_error"]
            st.put(keys, src, range(8)).wait(timeout=60)
            dst = make_layout("N 2 H B D", 8, head_dim=BIG)
            st.get(keys, dst, range(8)).wait(timeout=60)
            assert all(torch.equal(block_bits(src, b), block_bits(dst, b)) for b in range(8))
    finally:
        stop_node(proc, signal.SIGKILL)


def test_the_journal_keeps_what_was_committed_and_cuts_a_torn_tail(tmp_path):
    path = str(tmp_path / "journal")
    j = Journal(path)
    j.append(encode(Record(COMMIT, b"a", 0, 10, 5, "f", 7)) + encode(Record(COMMIT, b"b", 4096, 10, 6, "f", [[0, 1, 2]])))
    j.append(encode(Record(DROP, b"a", 0)))
    good = j.size
    j.append(encode(Record(COMMIT, b"c", 8192, 10, 7, "f", 9))[:-3])  # a record cut short (a kill mid-append)
    j.close()
    records, size, torn = replay(path)
    assert [(r.kind, r.key) for r in records] == [(COMMIT, b"a"), (COMMIT, b"b"), (DROP, b"a")]
    assert records[1].crc == [[0, 1, 2]] and size == good and torn
    data = bytearray(open(path, "rb").read())
    data[40] ^= 1  # a flipped bit in the first record: nothing after it is trusted
    open(path, "wb").write(bytes(data))
    assert replay(path)[0] == []


def _on_disk(node, keys) -> list:
    return [i for i, k in enumerate(keys) if node.tiers.disk.contains(k)]


def test_a_promoted_object_evicted_again_is_relinked_without_a_write(tmp_path):
    """Objects read back from disk keep their bytes there as shadows; evicted from DRAM
    again, each takes its shadow back (same chunk, nothing written: ``disk_relinks`` up,
    write-back counters and the data file's written bytes unchanged), then reads back
    bitwise, also after a restart (the relink's commit record is the first write's)."""
    src = make_layout("2 N B H D", 16, seed=10, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 16), 4, salt=b"shadows")
    with disk_node(tmp_path) as node:
        with _store(node) as writer:
            for i in range(0, 16, 4):
                writer.put(keys[i:i + 4], src, range(i, i + 4)).wait(timeout=60)
                until(lambda: _settled(node), "write-back settled", timeout=30, interval=0.01)
        on_disk = _on_disk(node, keys)
        assert len(on_disk) >= 8
        promoted, later = on_disk[:4], on_disk[4:8]
        dst = make_layout("N 2 H B D", 16, head_dim=BIG)
        with _store(node) as st:  # gets only: no spare slots held
            h = st.get([keys[i] for i in promoted], dst, promoted)
            h.wait(timeout=60)
            assert h.result.from_disk == 4
            until(lambda: _settled(node), "write-back settled", timeout=30, interval=0.01)
            disk = node.tiers.disk
            chunks = {i: disk.shadows[keys[i]].offset for i in promoted}
            before = node.stats()
            assert before["disk_shadows"] == 4 and before["disk_shadow_bytes"] == 4 * 122880
            rest = [i for i in range(16) if node.index.contains(keys[i]) and i not in promoted]
            st.get([keys[i] for i in rest], dst, rest).wait(timeout=60)  # the promoted are DRAM's LRU now
            h = st.get([keys[i] for i in later], dst, later)  # read back: DRAM evicts the promoted
            h.wait(timeout=60)
            assert h.result.from_disk == 4
            until(lambda: _settled(node), "evictions settled", timeout=30, interval=0.01)
            after = node.stats()
            assert after["disk_relinks"] - before["disk_relinks"] == 4
            assert after["dram_evictions"] - before["dram_evictions"] == 4
            for name in ("writeback_bytes", "writeback_objects", "writeback_drops", "disk_bytes_written"):
                assert after[name] == before[name], name
            assert {i: disk.peek(keys[i]).offset for i in promoted} == chunks  # the same chunks
            assert after["disk_shadows"] == 4  # now the later ones'
            back = make_layout("N 2 B H D", 16, head_dim=BIG)
            h = st.get([keys[i] for i in promoted], back, promoted)
            h.wait(timeout=60)
            assert h.result.from_disk == 4
            for i in promoted:
                assert torch.equal(block_bits(src, i), block_bits(back, i))
    with disk_node(tmp_path) as node, _store(node) as st:  # DRAM was flushed (shadows relinked): all on disk
        s = node.stats()
        assert s["disk_recovered"] == 16 and s["dram_objects"] == 0
        back = make_layout("2 N B H D", 16, head_dim=BIG)
        h = st.get(keys[:16], back, range(16))
        h.wait(timeout=60)
        assert h.result.from_disk == 16 and node.stats()["disk_bad_objects"] == 0
        for b in range(16):
            assert torch.equal(block_bits(src, b), block_bits(back, b))


def test_a_promoted_object_dropped_for_its_checksum_takes_its_shadow_along(tmp_path):
    """A promoted object whose DRAM bytes fail a reader's checksum is dropped with its
    shadow (drop record written: it is not back after a restart either); the key put again
    with other bytes is written back anew, never relinked to the old shadow."""
    src = make_layout("2 N B H D", 16, seed=11, head_dim=BIG)
    other = make_layout("2 N B H D", 16, seed=12, head_dim=BIG)
    keys = kvxfer.block_keys(range(4 * 16), 4, salt=b"shadow-drop")
    with disk_node(tmp_path) as node:
        with _store(node) as writer:
            for i in range(0, 16, 4):
                writer.put(keys[i:i + 4], src, range(i, i + 4)).wait(timeout=60)
                until(lambda: _settled(node), "write-back settled", timeout=30, interval=0.01)
        k = _on_disk(node, keys)[0]
        dst = make_layout("N 2 B H D", 16, head_dim=BIG)
        with _store(node) as st:
            st.get([keys[k]], dst, [k]).wait(timeout=60)
            until(lambda: _settled(node), "settled", timeout=30, interval=0.01)
            assert keys[k] in node.tiers.disk.shadows
            at = node.index.peek(keys[k]).offset + 77
            node.buffer[at] ^= 0x20  # the DRAM copy goes bad
            with pytest.raises(kvxfer.StoreMiss):
                st.get([keys[k]], dst, [k]).wait(timeout=60)
            until(lambda: keys[k] not in node.tiers.disk.shadows, "the shadow dropped", timeout=30)
            s = node.stats()
            assert s["disk_shadows"] == 0 and s["bad_objects"] == 1 and st.lookup([keys[k]]) == 0
            assert [r.kind for r in replay(str(tmp_path / "journal"))[0] if r.key == keys[k]][-1] == DROP
            relinks, written = s["disk_relinks"], s["writeback_objects"]
            st.put([keys[k]], other, [k]).wait(timeout=60)  # the key again, other bytes
            fresh = kvxfer.block_keys(range(4 * 16), 4, salt=b"shadow-drop-fresh")
            for i in range(0, 16, 4):  # push it out of DRAM
                st.put(fresh[i:i + 4], src, range(i, i + 4)).wait(timeout=60)
                until(lambda: _settled(node), "write-back settled", timeout=30, interval=0.01)
            assert node.tiers.disk.contains(keys[k])
            s = node.stats()
            assert s["disk_relinks"] == relinks and s["writeback_objects"] > written
            back = make_layout("N 2 H B D", 16, head_dim=BIG)
            h = st.get([keys[k]], back, [k])
            h.wait(timeout=60)
            assert h.result.from_disk == 1 and torch.equal(block_bits(other, k), block_bits(back, k))
    with disk_node(tmp_path) as node, _store(node) as st:
        back = make_layout("2 N B H D", 16, head_dim=BIG)
        st.get([keys[k]], back, [k]).wait(timeout=60)
        assert torch.equal(block_bits(other, k), block_bits(back, k))


def test_a_write_that_ends_after_the_directory_vanished_is_not_committed(tmp_path):
    """The tier notices a removed directory while a write is in flight (its completion not
    polled yet): the tier is empty and its state says so, and the write ending afterwards
    is not committed into it (the write-back is a miss, never an object of a dead tier)."""
    import select

    from kvxfer.store.disk import DiskTier

    gone = []
    tier = DiskTier(str(tmp_path / "tier"), 4 << 20, SLOT, on_gone=gone.append)
    try:
        buf = kvxfer.shared_empty(SLOT)
        buf.fill_(7)
        first = tier.write(b"k1", SLOT, "f", 0, buf.data_ptr(), hash_bytes=True)
        select.select([tier.file.event_fd], [], [], 30)
        assert [ok for *_, ok in tier.poll()] == [True] and tier.contains(b"k1") and first.committed
        tier.write(b"k2", SLOT, "f", 0, buf.data_ptr(), hash_bytes=True)
        select.select([tier.file.event_fd], [], [], 30)  # ended, not polled
        shutil.rmtree(tmp_path / "tier")
        tier.check(0.0)
        assert tier.state == "vanished" and not tier.objects and gone == [b"k1"] and tier.bytes_used == 0
        assert [(k, ok) for k, _, _, ok in tier.poll()] == [("write", False)]
        assert not tier.contains(b"k2") and tier.stats()["disk_objects"] == 0 and not tier.writable
    finally:
        tier.close()
