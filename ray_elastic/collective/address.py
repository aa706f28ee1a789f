"""Which local address a worker's Gloo ring listens on, and what to say when a ring cannot connect.

Left alone, Gloo advertises the address this machine's hostname resolves to.
On many Debian/Ubuntu hosts and containers that is 127.0.0.1 or 127.0.1.1
(`/etc/hosts`), which peers on other machines cannot reach: the ring never
forms. Ray already knows the address other nodes reach this one at (its node
IP), so every ring binds there:

- torch Gloo reads only an interface name (`GLOO_SOCKET_IFNAME`), so the ring
  is created with it set to the interface that carries the node IP;
- pygloo takes the address itself.

A `GLOO_SOCKET_IFNAME` the user set (in the worker's environment, e.g.
through `runtime_env`) wins, as it does in torch and Horovod.

Every rank also writes the address it advertises into the KV actor under its
generation, so a ring that does not form can say which addresses were tried.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address
_SIOCGIFCONF = 0x8912  # Linux: every (interface, IPv4 address) pair, secondary addresses included
ENV = "GLOO_SOCKET_IFNAME"


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for every address of this network namespace (Linux), [] where unknown."""
    pairs: list[tuple[str, str]] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        size = 40  # sizeof(struct ifreq) on 64-bit Linux
        buf = array.array("B", b"\0" * size * 256)
        address, _ = buf.buffer_info()
        filled = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, struct.pack("iL", len(buf), address)))[0]
        raw = buf.tobytes()[:filled]
        for offset in range(0, filled, size):
            name = raw[offset : offset + 16].split(b"\0", 1)[0].decode()
            pairs.append((name, socket.inet_ntoa(raw[offset + 20 : offset + 24])))
    if pairs:
        return pairs
    for _, name in socket.if_nameindex():  # fallback: primary addresses only
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            pairs.append((name, socket.inet_ntoa(packed[20:24])))
    return pairs


def interface_of(ip: str) -> str | None:
    """The name of the local interface that holds IPv4 address `ip`, or None."""
    for name, address in _ipv4_addresses():
        if address == ip:
            return name
    return None


@dataclass(frozen=True)
class GlooBinding:
    """Where this worker's Gloo listens: an address, the interface holding it, and who chose them."""

    ip: str
    interface: str | None
    chosen_by: str  # "GLOO_SOCKET_IFNAME" (the user's) or "the Ray node IP"

    @property
    def user_set(self) -> bool:
        return self.chosen_by == ENV

    def describe(self) -> str:
        if self.user_set:
            return f"interface {self.interface} ({ENV} set in the worker's environment)"
        where = f"interface {self.interface}" if self.interface else "no local interface found for it"
        return f"{self.ip} ({where}; the Ray node IP)"


def gloo_binding(node_ip: str) -> GlooBinding:
    """Where Gloo should listen in a worker on the Ray node whose address is `node_ip`."""
    user = os.environ.get(ENV)
    if user:
        return GlooBinding(node_ip, user, ENV)
    return GlooBinding(node_ip, interface_of(node_ip), "the Ray node IP")


@contextlib.contextmanager
def socket_ifname(binding: GlooBinding) -> Iterator[None]:
    """`GLOO_SOCKET_IFNAME` set to the binding's interface while torch creates its Gloo device, then restored."""
    if binding.user_set or binding.interface is None:
        yield
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = binding.interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def address_key(rank: int) -> str:
    return f"gloo-address/{rank}"


def ring_failure_hint(binding: GlooBinding, rank: int, peers: dict[int, str]) -> str:
    """What a rank says when its ring did not form: its address and the ones its peers advertised."""
    others = ", ".join(f"rank {r}: {text}" for r, text in sorted(peers.items()) if r != rank) or "none known"
    return (
        f"rank {rank} listened on {binding.describe()}; its peers advertised {others}. "
        f"Every node must reach the others at these addresses; set {ENV} in the workers' environment "
        "to the interface to use if they cannot"
    )
