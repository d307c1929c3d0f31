"""Dependencies shared by the routes: the gateway, the API key, readiness, and 422s in FastAPI's own shape."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status

from service.api.gateway import Gateway
from service.ask import Asker
from workers.runtime import Runtime


def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def require_api_key(request: Request, gateway: GatewayDep) -> None:
    """Bearer token check when KVSTITCH_API_KEY is set (constant-time compare)."""
    expected = gateway.settings.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong API key: send Authorization: Bearer <KVSTITCH_API_KEY>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def ready_runtime(gateway: GatewayDep) -> Runtime:
    """The runtime, or 503 while the server starts (or after a failed start)."""
    if gateway.runtime is None or not gateway.ready:
        raise not_ready(gateway)
    return gateway.runtime


def ready_asker(gateway: GatewayDep) -> Asker:
    if gateway.asker is None or not gateway.ready:
        raise not_ready(gateway)
    return gateway.asker


def not_ready(gateway: Gateway) -> HTTPException:
    reason = gateway.startup_error or "the model is still loading"
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"not ready: {reason}", headers={"Retry-After": "5"}
    )


def field_error(field: str, message: str, where: str = "body") -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, for bounds that come from settings."""
    detail: list[dict[str, Any]] = [{"loc": [where, field], "msg": message, "type": "value_error"}]
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=detail)


def unavailable(message: str, retry_after_s: int = 5) -> HTTPException:
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE, detail=message, headers={"Retry-After": str(retry_after_s)}
    )
