"""Free ports: chosen together, they differ (a master told one port for two servers dies)."""

import socket

from rlplane_service.net import free_port, free_ports


def test_ports_chosen_together_all_differ_and_are_free():
    ports = free_ports("127.0.0.1", 64)
    assert len(set(ports)) == 64
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free after the choice


def test_one_free_port():
    port = free_port()
    assert 1024 <= port <= 65535
