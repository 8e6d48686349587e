"""engine.port's check agrees with what the engine can bind."""

import socket

import pytest

from eagle3lib.engines.server import EngineError, check_port, free_port


def served_once(port: int) -> None:
    """A server as uvicorn binds one (SO_REUSEADDR) answers a connection, closes it first, and stops: the
    server's side of that connection is left in TIME_WAIT on the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()  # the server closes first, as after a `Connection: close` request
            client.recv(1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:  # the old check's bind, without the option
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))


def test_a_port_left_in_time_wait_by_a_stopped_engine_is_free():
    port = free_port("127.0.0.1")
    served_once(port)
    check_port("127.0.0.1", port)


def test_a_port_someone_listens_on_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} .* taken"):
            check_port("127.0.0.1", port)
