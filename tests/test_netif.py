"""distopt.dist.netif: the interface a process listens on, from its route toward the rendezvous."""

from __future__ import annotations

import os
import socket

import pytest

from distopt.dist import netif
from distopt.errors import ConfigError


def _loopback() -> str:
    return next(n for n, addrs in netif.addresses().items() if "127.0.0.1" in addrs)


def test_auto_is_loopback_toward_a_loopback_address() -> None:
    for toward in ("127.0.0.1", "localhost"):
        assert netif.choose("auto", toward=toward, key="ps.interface") == _loopback()


def test_a_missing_interface_is_one_line_naming_the_host_and_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        netif.choose("nosuch0", toward="127.0.0.1", key="ps.interface")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{socket.gethostname()}: ps.interface: no interface 'nosuch0'")
    assert "set ps.interface to the interface that reaches MASTER_ADDR 127.0.0.1" in message


def test_loopback_toward_another_host_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'lo' is loopback, which cannot reach MASTER_ADDR "):
        netif.choose(_loopback(), toward="192.0.2.7", key=netif.ENV_KEY)


def test_an_unresolvable_master_is_one_line_naming_it() -> None:
    with pytest.raises(
        ConfigError, match=r": MASTER_ADDR 'no-such-host\.invalid' does not resolve"
    ):
        netif.choose("auto", toward="no-such-host.invalid", key="ps.interface")


def test_pin_gloo_keeps_a_named_interface_and_checks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", _loopback())
    assert netif.pin_gloo("127.0.0.1") == _loopback()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ConfigError, match=r"GLOO_SOCKET_IFNAME \(--iface\): no interface"):
        netif.pin_gloo("127.0.0.1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    assert netif.pin_gloo("127.0.0.1") == _loopback()
    assert "TP_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({}, 1),
        ({"GROUP_WORLD_SIZE": "3"}, 3),
        ({"SLURM_JOB_NODELIST": "node0"}, 1),
        ({"SLURM_JOB_NODELIST": "node[0-1]"}, 2),
        ({"SLURM_JOB_NODELIST_HET_GROUP_0": "a", "SLURM_JOB_NODELIST_HET_GROUP_1": "b"}, 2),
    ],
)
def test_job_nodes(env: dict[str, str], nodes: int) -> None:
    assert netif.job_nodes(env) == nodes


def test_a_store_host_whose_own_name_is_loopback_fails_on_a_multi_node_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netif, "hostname", lambda: "localhost")
    netif.check_not_loopback_across_hosts("localhost", nodes=1, address_key="MASTER_ADDR")
    with pytest.raises(ConfigError) as caught:
        netif.check_not_loopback_across_hosts("localhost", nodes=2, address_key="MASTER_ADDR")
    assert str(caught.value).startswith(
        "localhost: MASTER_ADDR 'localhost' resolves to "
    ) and "(loopback) on this host, but the job spans 2 nodes" in str(caught.value)


def test_pinned_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Left set, one group's interface passed as the user's own setting to the process's next
    # group (toward another host) and to every process it started.
    for key in netif.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    with netif.pinned("auto", toward="127.0.0.1", key="ps.interface") as name:
        assert name == _loopback()
        assert all(os.environ[key] == name for key in netif.ENV_KEYS)
    assert not any(key in os.environ for key in netif.ENV_KEYS)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", _loopback())
    with netif.pinned("auto", toward="127.0.0.1", key="ps.interface"):
        pass
    assert os.environ["GLOO_SOCKET_IFNAME"] == _loopback() and "TP_SOCKET_IFNAME" not in os.environ
