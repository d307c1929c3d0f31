"""`kvstitch serve` / `engine` log levels: the service's INFO lines stay, the HTTP clients' per-request ones go."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from service.commands.logs import CHATTY_CLIENTS, serving_logs


@pytest.fixture
def restored_levels() -> Iterator[None]:
    names = ["", *CHATTY_CLIENTS]
    before = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.usefixtures("restored_levels")
def test_serving_logs_keep_the_services_info_and_drop_the_clients_request_lines() -> None:
    logging.getLogger().setLevel(logging.WARNING)
    serving_logs()
    assert logging.getLogger("kvstitch.requests").isEnabledFor(logging.INFO)
    assert logging.getLogger("service.serving.server").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpcore.connection").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
