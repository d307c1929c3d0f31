"""The start-up checks every serving process reports first on `/readyz`: the embedded gateway (`server.py`) and
an engine process (`engine_server.py`) alike; each adds its own (Qdrant, engines, load) after them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from service.kvcache.index import KVIndex
from service.serving.runtime import GateOutcome


def startup_checks(
    started: threading.Event, startup_error: str | None, index: KVIndex | None, gate: GateOutcome | None
) -> dict[str, Any]:
    """Start-up, model, gate and the KV index's reachability; `index`: the runtime's, None until the runtime (the
    model loaded) exists."""
    checks: dict[str, Any] = {}
    if startup_error is not None:
        checks["startup"] = startup_error
    elif not started.is_set():
        checks["startup"] = "loading"
    checks["model"] = "loaded" if index is not None else "not loaded"
    checks["gate"] = gate_state(gate)
    if index is not None:
        checks["index"] = probe(index.total_bytes)
    return checks


def gate_state(gate: GateOutcome | None) -> str:
    if gate is None:
        return "pending"
    if gate.skipped:
        return "skipped"
    state = f"{'passed' if gate.passed else 'failed'} (max |logit diff| {gate.max_abs_logit_diff:.2e}"
    if gate.shared_max_abs_logit_diff is not None:
        verdict = "" if gate.shared_passed else " failed: the copy path serves"
        state += f"; zero-copy {gate.shared_max_abs_logit_diff:.2e}{verdict}"
    return state + ")"


def probe(check: Callable[[], object]) -> str:
    """ "ok", or why `check` failed (any failure means the store behind it cannot serve now)."""
    try:
        check()
    except Exception as err:
        return f"unreachable: {type(err).__name__}: {err}"
    return "ok"
