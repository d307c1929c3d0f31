"""Log levels of the long-running commands (`kvstitch serve`, `kvstitch engine`)."""

from __future__ import annotations

import logging

# Client libraries that log one INFO line per HTTP request they make: the gateway's engine client makes one per
# answer, which doubles the request log (kvstitch.requests already has a line per answer) and costs event-loop time.
CHATTY_CLIENTS = ("httpx", "httpcore")


def serving_logs() -> None:
    """INFO for the service's own loggers; WARNING for the HTTP clients' per-request lines."""
    logging.getLogger().setLevel(logging.INFO)
    for name in CHATTY_CLIENTS:
        logging.getLogger(name).setLevel(logging.WARNING)
