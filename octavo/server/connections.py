"""Connections that cannot pile up: uvicorn's HTTP/1.1 protocol with a deadline for each request's
head and a cap on open connections.

uvicorn times out a connection only between requests (keep-alive, after a response); one that is
opened and then sends nothing, or sends its headers a byte at a time, stays open for ever, and
enough of them exhaust the process's file descriptors, after which nobody is served. Here:
- a connection that has not delivered a whole request head within `header_timeout_s` of opening
  (or of its previous response) is closed (the request body's pace is the guard's: guard.py);
- past `max_connections` open connections a new one is answered 503 and closed at once, before
  it can hold a descriptor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("octavo.server")

DEFAULT_HEADER_TIMEOUT_S = 30.0
_RESERVED_FDS = 256  # model files, the grammar compiler's pipes, logs, upstream sockets
_REFUSAL_BODY = (b'{"error": {"message": "too many open connections; retry later", "type": "ServiceUnavailableError", '
                 b'"param": null, "code": 503}}')
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSAL_BODY), _REFUSAL_BODY))


def default_max_connections() -> int:
    """What the descriptor limit allows, once raised to its hard limit: all but a reserve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(64, min(soft, 65536) - _RESERVED_FDS)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the head deadline and the connection cap (see the module docstring)."""

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_at_last_check: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            logger.warning("refused a connection: %d are open (--max-connections)", len(self.connections))
            transport.write(_REFUSAL)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:  # refused in connection_made: uvicorn never saw it
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._cycle_at_last_check = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._check_head)

    def _check_head(self) -> None:
        """Every header_timeout_s: a connection with no request in flight that has not started a new
        one since the last check (the same finished cycle, or none at all) is closed."""
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if not in_flight and self.cycle is self._cycle_at_last_check:
            logger.info("closed a connection that sent no whole request head in %.0f s", self.header_timeout_s)
            self.transport.close()
            return
        self._arm()


def protocol_factory(header_timeout_s: float, max_connections: int) -> Any:
    """The `http` class to hand uvicorn.Config."""
    return functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s, max_connections=max_connections)
