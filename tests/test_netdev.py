import pytest

from kvxfer.transport.netdev import net_devices_for, rdma_ports


def test_loopback_address_maps_to_lo_only():
    devices = net_devices_for("127.0.0.1").split(",")
    assert devices[0] == "lo"
    assert all(":" in d for d in devices[1:])  # the rest can only be RDMA ports


def test_wildcard_keeps_ucx_default():
    assert net_devices_for("0.0.0.0") is None
    assert net_devices_for("") is None


def test_foreign_address_is_refused():
    with pytest.raises(ValueError, match="not an address of any local interface"):
        net_devices_for("203.0.113.77")


def test_rdma_ports_from_sysfs(tmp_path):
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "mlx5_1" / "ports" / "1").mkdir(parents=True)
    assert rdma_ports(str(tmp_path)) == ["mlx5_0:1", "mlx5_1:1"]
    assert rdma_ports(str(tmp_path / "absent")) == []


def test_agent_listens_only_on_the_address_asked_for():
    psutil = pytest.importorskip("psutil")
    torch = pytest.importorskip("torch")
    import kvxfer

    pool = torch.zeros(8, 2, 16, 2, 8)
    with_listen = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN}
    agent = kvxfer.Agent("a", listen="127.0.0.1:0", secret=b"s" * 16)
    try:
        agent.register_kv(kvxfer.KVLayout.from_tensors(pool, "N 2 B H D"))
        now = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN}
    finally:
        agent.close()
    assert now - with_listen <= {"127.0.0.1"}, now
