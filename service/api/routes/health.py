"""Liveness, readiness and metrics: open to everyone (probes and Prometheus carry no API key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import FacadeDep
from service.api.openapi import Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is alive (it may still be loading the model)."""
    return {"status": "ok"}


@router.get("/health")
def health() -> dict[str, str]:
    """The same probe as /healthz, under the name vLLM and SGLang serve it."""
    return healthz()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(facade: FacadeDep) -> Any:
    """Model loaded, gate passed, KV index and Qdrant reachable; 503 naming what is not."""
    report = facade.readiness()
    return JSONResponse(report, status_code=200 if report["ready"] else 503)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(facade: FacadeDep) -> Response:
    """Prometheus exposition."""
    return Response(facade.metrics_text(), media_type=CONTENT_TYPE_LATEST)
