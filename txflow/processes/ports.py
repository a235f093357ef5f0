"""TCP ports: a socket bound for a child to serve on, a free one to bind, and whether one accepts connections."""

from __future__ import annotations

import os
import socket

# The variable that tells a child which inherited file descriptor is its listening socket.
LISTEN_FD_ENV = "TXFLOW_LISTEN_FD"


def listener(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port of `host` and listening, for a child to inherit and serve on.

    A port picked by binding and closing (`free_port`) stays free until the child binds it again, and any
    local user may bind it first and receive the requests meant for the child (the first carries its key);
    a port that stays bound from the pick to the child's serving has no such gap."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind((host, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def inherited_listener() -> socket.socket | None:
    """The listening socket this process inherited (LISTEN_FD_ENV), or None; the variable is removed so
    that a child of this process does not take the number for its own."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is None:
        return None
    sock = socket.socket(fileno=int(fd))  # family and type read from the descriptor itself
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        raise OSError(f"{LISTEN_FD_ENV}={fd} is no TCP socket")
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (another process can bind it before the caller does:
    for a port a child serves on, hand it a `listener` instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
