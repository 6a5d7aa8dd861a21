"""Which network devices UCX may open, so nothing listens beyond the agent's address.

UCX's TCP transport opens a listening socket on every network interface it
uses. An agent asked to listen on one address must not expose more than that,
so the UCX devices are narrowed to the interface(s) holding that address, plus
the host's RDMA ports (``mlx5_0:1`` ...), which listen on no IP socket and are
what GPUDirect RDMA needs. A wildcard address (``0.0.0.0``, ``::``) keeps
UCX's default of every device.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915
_WILDCARD = {"", "0.0.0.0", "::", "*"}


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def rdma_ports(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """RDMA device ports as UCX names them (``mlx5_0:1``); empty without a NIC."""
    try:
        devices = sorted(os.listdir(sysfs))
    except OSError:
        return []
    ports = []
    for dev in devices:
        try:
            ports += [f"{dev}:{p}" for p in sorted(os.listdir(os.path.join(sysfs, dev, "ports")))]
        except OSError:
            continue
    return ports


def net_devices_for(host: str) -> str | None:
    """``UCX_NET_DEVICES`` value for an agent listening on ``host``; None means all.

    Raises ``ValueError`` when ``host`` is no address of this machine.
    """
    if host in _WILDCARD:
        return None
    try:
        addr = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"cannot resolve listen host {host!r}: {exc}") from None
    if ipaddress.ip_address(addr).is_unspecified:
        return None
    ifnames = [name for _, name in socket.if_nameindex() if _ipv4_of(name) == addr]
    if not ifnames:
        raise ValueError(f"listen host {host!r} ({addr}) is not an address of any local interface")
    return ",".join(ifnames + rdma_ports())
