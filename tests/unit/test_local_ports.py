"""A restarted local head keeps its ports when they are free, so the dashboard links on task pages still answer."""

from __future__ import annotations

import socket

from airflow_provider_raytpu.backends.local.process import port_if_free


def listening() -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_a_port_in_use_is_replaced_by_the_fallback() -> None:
    with listening() as server:
        port = server.getsockname()[1]
        assert port_if_free(f"127.0.0.1:{port}", 1) == 1
        assert port_if_free(f"http://127.0.0.1:{port}", 1) == 1


def test_a_port_whose_server_stopped_is_kept_though_its_connections_linger() -> None:
    server = listening()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    server.close()
    client.close()
    assert port_if_free(f"http://127.0.0.1:{port}", 1) == port


def test_no_address_or_no_port_gives_the_fallback() -> None:
    assert [port_if_free(value, 7) for value in (None, "", "127.0.0.1", "127.0.0.1:x")] == [7, 7, 7, 7]
