"""The import rules of docs/architecture.md, checked on the source: a new import across a seam fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The only modules under service/ that may start a worker, hence import `workers`.
ENTRY_POINTS = ("service/cli.py", "service/__main__.py", "service/commands/")
# What the HTTP layer may import of the rest of the service: the facade package alone (its protocol, its plain
# value types, its errors).
HTTP_ALLOWED = ("service.api", "service.facade")
CORE = (
    "service/engine/",
    "service/kvcache/",
    "service/retrieval/",
    "service/jobs/",
    "service/formats/",
    "service/fleet/",
)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def sources(prefix: str) -> list[tuple[str, set[str]]]:
    files = sorted((ROOT / prefix).rglob("*.py")) if prefix.endswith("/") else [ROOT / prefix]
    return [(p.relative_to(ROOT).as_posix(), imports_of(p)) for p in files]


def offenders(prefix: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    bad = {}
    for name, modules in sources(prefix):
        if name.startswith(skip):
            continue
        hits = sorted(m for m in modules if m.split(".")[0] in forbidden or m.startswith(forbidden))
        if hits:
            bad[name] = hits
    return bad


def test_nothing_under_service_imports_workers_but_the_cli_entry_points() -> None:
    assert offenders("service/", ("workers",), skip=ENTRY_POINTS) == {}


def test_the_entry_points_are_where_the_worker_is_started() -> None:
    """The rule above must not pass vacuously: `serve` does hand the worker loop to the service."""
    assert any(m.startswith("workers") for _, modules in sources("service/commands/") for m in modules)


def test_the_http_layer_sees_only_the_facade() -> None:
    bad = {}
    for name, modules in sources("service/api/"):
        hits = sorted(m for m in modules if m.startswith("service.") and not m.startswith(HTTP_ALLOWED))
        if hits:
            bad[name] = hits
    assert bad == {}


@pytest.mark.parametrize("package", CORE)
def test_the_core_imports_neither_http_nor_workers_nor_the_root(package: str) -> None:
    forbidden = ("workers", "fastapi", "service.api", "service.serving", "service.usecases", "service.facade")
    assert offenders(package, forbidden) == {}


def test_the_kv_store_knows_of_the_engine_only_its_block_layout() -> None:
    """kvcache takes a precompute callable and layer groups; of the engine it needs only the block layout."""
    engine_imports = {
        m for _, modules in sources("service/kvcache/") for m in modules if m.startswith("service.engine")
    }
    assert engine_imports == {"service.engine.kv_layout"}


def test_the_block_layout_imports_nothing_else_of_the_project() -> None:
    """So "kvcache imports only the block layout" brings nothing else of the engine with it."""
    ((_, modules),) = sources("service/engine/kv_layout.py")
    assert sorted(m for m in modules if m.startswith(("service", "workers"))) == []


def test_the_scheduler_gets_its_kv_through_the_port_it_is_handed() -> None:
    """The engine never reaches back up for chunk KV: nothing under service/engine/ imports the store, the use
    cases or the serving modules that hold them."""
    forbidden = ("service.kvcache", "service.usecases", "service.serving")
    assert offenders("service/engine/", forbidden) == {}
