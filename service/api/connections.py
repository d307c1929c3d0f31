"""Bounds on the connections themselves, below HTTP routing: how many may be open, and how long a client may take
to send a request's head and each piece of its body.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) and a request head's size, but not the time a
head or a body takes to arrive, and its `limit_concurrency` answers 503 only once a whole head has come. A client
that opens connections and sends half a header each therefore holds one file descriptor per connection for ever,
until the process runs out of them and stops accepting anyone. `GuardedH11Protocol` (uvicorn's h11 protocol with
three guards) closes that:

- a connection over `max_connections` makes room by closing the connection that has waited longest for a request
  head (a half-open or idle one, answered `408`); when every connection is busy with a request, the new one is
  answered `503` with `Retry-After` and closed as soon as it is accepted. So half-open connections cannot lock out
  a probe or a real client, and the descriptors in use stay bounded;
- a request head not complete `header_timeout_s` after the connection opened (or after the previous response on a
  kept-alive connection) is answered `408` and closed;
- a request body with no byte for `body_timeout_s` closes the connection (the route sees the client gone), unless
  reading is paused because the app has not taken what arrived: then the app is the slow one.

Logs under pressure: asyncio logs a traceback for every failed `accept()` when descriptors run out, thousands a
second; those lines, uvicorn's own warnings and the refusals here are rate-limited (`RateLimitedLog`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FD_RESERVE = 512  # descriptors kept for everything besides client connections (model files, stores, logs)
LOG_INTERVAL_S = 10.0
MAX_TEMPLATES = 1000
_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\nConnection: close\r\n"
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\nConnection: close\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0


def plain_response(head: bytes, text: str) -> bytes:
    body = text.encode()
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and head and body read timeouts (`guarded_protocol` binds the
    limits)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # The connections waiting for a request head, longest first (a dict keeps insertion order).
    waiting_for_head: ClassVar[dict[GuardedH11Protocol, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head" or "body"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            log.warning("connection refused: %d open (KVSTITCH_MAX_CONNECTIONS)", len(self.connections) - 1)
            transport.write(plain_response(_REFUSED, "too many connections, try again shortly\n"))
            transport.close()
            return
        self._wait("head", self.limits.header_timeout_s)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head; False when none waits for one."""
        if not self.waiting_for_head:
            return False
        oldest = next(iter(self.waiting_for_head))
        log.warning("connection closed to make room: %d open (KVSTITCH_MAX_CONNECTIONS)", len(self.connections) - 1)
        oldest._give_up("head")
        return True

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._wait("body", self.limits.body_timeout_s)  # the body's clock restarts with every piece
        elif state is h11.IDLE:
            if self._waiting_for != "head":  # a new head begins: its clock runs until the head is complete
                self._wait("head", self.limits.header_timeout_s)
        else:
            self._stop_waiting()  # the whole request is in: answering may take as long as it takes

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._wait("head", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _wait(self, what: str, seconds: float) -> None:
        self._stop_waiting()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, self._timed_out)
        if what == "head":
            self.waiting_for_head[self] = None

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None
        self.waiting_for_head.pop(self, None)

    def _timed_out(self) -> None:
        what = self._waiting_for
        if what == "body" and self.flow.read_paused:  # the app has not read what came: not the client's delay
            self._wait("body", self.limits.body_timeout_s)
            return
        setting = "KVSTITCH_HEADER_TIMEOUT_S" if what == "head" else "KVSTITCH_BODY_TIMEOUT_S"
        log.warning("connection closed: its request %s did not come in time (%s)", what, setting)
        self._give_up(what)

    def _give_up(self, what: str | None) -> None:
        self._stop_waiting()
        if self.transport.is_closing():
            return
        if what == "head":  # no response of this connection is under way: it can be told why
            self.transport.write(plain_response(_TIMED_OUT, "the request head took too long\n"))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class with these limits (uvicorn builds one protocol object per connection from the class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "waiting_for_head": {}})


def server_options(limits: ConnectionLimits) -> dict[str, Any]:
    """uvicorn's options (for `uvicorn.run` or `uvicorn.Config`) that serve through the guarded protocol, on
    asyncio's event loop: uvloop (installed for the engine's API) would be uvicorn's pick otherwise, and the
    guards and the rate-limited logs of failed accepts are built on asyncio's."""
    return {
        "http": guarded_protocol(limits),
        "loop": "asyncio",
        "timeout_keep_alive": max(1, round(limits.keep_alive_s)),
    }


def limit_log_floods() -> None:
    """Rate-limit what floods the log when descriptors run out or clients misbehave in bulk (this module's own
    warnings always are)."""
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(RateLimitedLog(LOG_INTERVAL_S))


def raise_fd_limit(limits: ConnectionLimits) -> int:
    """Raise this process's open-file limit (soft, up to the hard one) to fit `max_connections` and the reserve;
    the limit now. Past it, `accept()` fails and nobody, not even a probe, gets in."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "open-file limit %d is below KVSTITCH_MAX_CONNECTIONS + %d: raise `ulimit -n` or lower the setting",
            soft,
            FD_RESERVE,
        )
    return int(soft)


class RateLimitedLog(logging.Filter):
    """Lets each message template through at most once per `interval_s`; the next one let through says how many
    were held back."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        if len(self._last) > MAX_TEMPLATES:  # messages with varying text must not grow this for ever
            self._last.clear()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.interval_s:.0f} s not logged)"
        return True


log.addFilter(RateLimitedLog(LOG_INTERVAL_S))
