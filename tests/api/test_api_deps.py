"""The routes' facade dependency is read on the event loop: no request pays a thread-pool hop for it."""

from __future__ import annotations

from typing import Annotated, Any

import fastapi.dependencies.utils
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.deps import FacadeDep


def one() -> int:
    return 1


def test_the_facade_dependency_takes_no_thread_pool_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    hops: list[str] = []
    original = fastapi.dependencies.utils.run_in_threadpool

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__name__", repr(func)))
        return await original(func, *args, **kwargs)

    monkeypatch.setattr(fastapi.dependencies.utils, "run_in_threadpool", counted)
    facade = object()
    app = FastAPI()
    app.state.facade = facade

    @app.get("/facade")
    async def read(found: FacadeDep) -> dict[str, bool]:
        return {"same": found is facade}

    @app.get("/sync-dependency")
    async def sync_dependency(found: Annotated[int, fastapi.Depends(one)]) -> dict[str, Any]:
        return {"found": found}

    with TestClient(app) as client:
        assert client.get("/facade").json() == {"same": True}
        assert hops == []
        assert client.get("/sync-dependency").json() == {"found": 1}
        assert hops == ["one"]  # the counter sees a plain function's hop: the first check can fail
