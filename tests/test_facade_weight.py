"""The facade is narrow in weight: the HTTP layer's view of the service imports no torch and no client library.

Run in a fresh interpreter, since this test process has loaded the engine already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the facade must not pull in: the engine's stack and the backing services' clients.
HEAVY = ("torch", "transformers", "numpy", "qdrant_client", "redis", "sentence_transformers", "fastapi")
PROBE = """
import json, sys
import service.facade, service.facade.types, service.facade.errors, service.facade.engine
print(json.dumps(sorted(sys.modules)))
"""


def modules_after_importing_the_facade() -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    modules: list[str] = json.loads(done.stdout)
    return modules


def test_importing_the_facade_loads_no_engine_stack_and_no_client() -> None:
    modules = modules_after_importing_the_facade()

    assert [m for m in modules if m.split(".")[0] in HEAVY] == []


def test_the_facade_reaches_only_plain_value_modules_of_the_service() -> None:
    """What of the project it loads: the facade and the few torch-free modules whose values it re-exports."""
    project = {m for m in modules_after_importing_the_facade() if m.split(".")[0] == "service"}

    assert project == {
        "service",
        "service.engine",
        "service.engine.recompute_spec",
        "service.errors",
        "service.facade",
        "service.facade.engine",
        "service.facade.errors",
        "service.facade.types",
        "service.jobs",
        "service.jobs.documents",
        "service.jobs.job_status",
        "service.packed_ids",
        "service.plain_json",
        "service.retrieval",
        "service.retrieval.document_summary",
        "service.search_filter",
    }
