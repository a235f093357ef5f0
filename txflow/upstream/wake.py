"""Wake-ups between the Tinker API and its engine, which otherwise find each other's work only by
polling their shared database (the `wake-channel` change).

Each end owns a datagram socket in Linux's abstract namespace (no file to clean up; it goes with its
process), named `<name>-api` and `<name>-engine` after the name both find in `ENV`. After a database
commit the other end must see (a new request, a finished one), one end sends an empty wake to the
other, which then looks at once instead of at the end of its sleep. A wake carries nothing and proves
nothing: it only ends a wait early, and the database stays the only source of truth. So a stray wake
costs one look, and a missing one (no `ENV`, a name taken) leaves the polling both ends always keep.
A wake is never lost while it matters: the receiver drains its queue before it looks, so any commit
after that look sends a wake the next wait sees.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import socket
import sys
import time

ENV = "TXFLOW_WAKE"
COALESCE_S = 0.01
"""After a wake, the engine waits until this long passes without another, so that requests a client
sends together (a step's forward_backward and optim_step, an RL step's samples) are taken in one
batch, as they were in one of upstream's 0.1 s sleeps."""


def new_name() -> str:
    return f"txflow-wake-{secrets.token_hex(8)}"


class Channel:
    """This end's socket and the address of the other end."""

    def __init__(self, name: str, own: str, peer: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(f"\0{name}-{own}")
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._peer = f"\0{name}-{peer}"

    @classmethod
    def from_env(cls, own: str, peer: str) -> Channel | None:
        """The channel `ENV` names, or None (no name, or it cannot be bound): polling alone, as upstream."""
        name = os.environ.get(ENV)
        if not name:
            return None
        try:
            return cls(name, own, peer)
        except OSError:
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self) -> None:
        try:
            self._sock.sendto(b"", self._peer)
        except OSError:
            pass  # the other end is not up yet, or gone, or has a full queue (so a wake is pending there)

    def drain(self) -> int:
        """Read every pending wake; how many there were."""
        count = 0
        while True:
            try:
                self._sock.recv(1)
            except BlockingIOError:
                return count
            count += 1

    def sleep(self, seconds: float) -> bool:
        """Sleep `seconds`, or less: after a wake, until `COALESCE_S` passes without another (never past
        `seconds`). Whether a wake came."""
        deadline = time.monotonic() + seconds
        timeout, woke = seconds, False
        while timeout > 0:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                break
            self.drain()
            woke = True
            timeout = min(COALESCE_S, deadline - time.monotonic())
        return woke

    def close(self) -> None:
        self._sock.close()


class AsyncWakes:
    """The channel on an asyncio loop: `event()` is the event the next wake sets. Take it BEFORE
    looking at the database, then wait on it: a wake that comes during the look is not missed."""

    def __init__(self, channel: Channel, loop: asyncio.AbstractEventLoop):
        self.channel = channel
        self._loop = loop
        self._event = asyncio.Event()
        loop.add_reader(channel.fileno(), self._on_wake)

    def _on_wake(self) -> None:
        self.channel.drain()
        # Said on arrival, not where a wait ends: a result that a look finds completed ends no wait, though its wake
        # came, so the line would depend on timing.
        say_once(self, "the engine's wakes reach the API")
        woken, self._event = self._event, asyncio.Event()
        woken.set()

    def event(self) -> asyncio.Event:
        return self._event

    def close(self) -> None:
        self._loop.remove_reader(self.channel.fileno())
        self.channel.close()


def say_once(holder, text: str) -> None:
    """One line in this process's log the first time a wake arrives: proof that the channel works."""
    if not getattr(holder, "said", False):
        holder.said = True
        print(f"txflow: {text} (the wake-channel patch)", file=sys.stderr, flush=True)
