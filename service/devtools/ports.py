"""Free loopback ports for servers started in other processes (each binds its port itself): the tests' servers and
the throwaway SeaweedFS (`seaweed.py`).

The ports come from below the kernel's ephemeral range: a port the kernel hands out with `bind(0)` is one it also
hands to outgoing connections, so under many client sockets (a load test's) a port found free could be taken by a
connection before the server binds it (CI saw `address already in use`). Runs of ports (`free_ports`) are checked
as a whole, for servers that listen on `first + N`."""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000
ATTEMPTS = 200


def ephemeral_start() -> int:
    """The first port the kernel may use for outgoing connections (32768 when it does not say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(ports: range) -> bool:
    """Whether every port of `ports` can be bound now (all held at once, so one run is checked as a whole)."""
    with ExitStack() as stack:
        for port in ports:
            probe = stack.enter_context(socket.socket())
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports, below the ephemeral range."""
    top = ephemeral_start() - count
    if top <= LOWEST_PORT:
        raise RuntimeError(f"no room for {count} ports below the ephemeral range ({top + count})")
    for _ in range(ATTEMPTS):
        first = random.randrange(LOWEST_PORT, top)
        if bindable(range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found in {ATTEMPTS} tries")


def free_port() -> int:
    return free_ports(1)
