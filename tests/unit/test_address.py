"""Where a worker's Gloo listens (pure: no Ray). The multi-IP runs are in tests/integration/test_netns.py."""

from __future__ import annotations

import os

import pytest

from ray_elastic.collective import address


def test_the_interface_holding_an_address_is_found():
    assert address.interface_of("127.0.0.1") == "lo"
    assert address.interface_of("203.0.113.7") is None  # TEST-NET-3: held by no interface
    pairs = address._ipv4_addresses()
    assert ("lo", "127.0.0.1") in pairs
    for name, ip in pairs:  # every address this machine has maps back to its interface
        assert address.interface_of(ip) in {n for n, a in pairs if a == ip}, (name, ip)


def test_the_ray_node_ip_is_used_unless_the_user_set_gloo_socket_ifname(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    binding = address.gloo_binding("127.0.0.1")
    assert (binding.ip, binding.interface, binding.user_set) == ("127.0.0.1", "lo", False)
    assert binding.describe() == "127.0.0.1 (interface lo; the Ray node IP)"
    unknown = address.gloo_binding("203.0.113.7")  # an address no interface here holds
    assert unknown.interface is None and "no local interface found" in unknown.describe()

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    users = address.gloo_binding("127.0.0.1")
    assert (users.interface, users.user_set) == ("eth7", True)
    assert "GLOO_SOCKET_IFNAME set in the worker's environment" in users.describe()


def test_torch_sees_the_interface_only_while_its_device_is_made(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with address.socket_ifname(address.gloo_binding("127.0.0.1")):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    with pytest.raises(RuntimeError), address.socket_ifname(address.gloo_binding("127.0.0.1")):
        raise RuntimeError("the ring did not form")
    assert "GLOO_SOCKET_IFNAME" not in os.environ, "restored when the ring fails too"
    # the user's setting is never touched
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with address.socket_ifname(address.gloo_binding("127.0.0.1")):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_a_ring_that_did_not_form_names_every_address_tried(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    hint = address.ring_failure_hint(
        address.gloo_binding("127.0.0.1"),
        1,
        {0: "10.0.0.1 (interface eth0; the Ray node IP)", 1: "mine", 2: "10.0.0.3 (interface eth0; the Ray node IP)"},
    )
    assert hint.startswith("rank 1 listened on 127.0.0.1 (interface lo; the Ray node IP)")
    assert "rank 0: 10.0.0.1" in hint and "rank 2: 10.0.0.3" in hint and "mine" not in hint
    assert "set GLOO_SOCKET_IFNAME" in hint
    assert "none known" in address.ring_failure_hint(address.gloo_binding("127.0.0.1"), 0, {})
