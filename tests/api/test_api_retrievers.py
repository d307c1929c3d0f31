"""The retriever example of docs/api.md, run as written against the real app under uvicorn, and the command line's
`kvstitch ask --filter` against the same server."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from api_support import ingest
from app_server import LiveServer
from test_api_filters import CORPUS, METADATA, QUESTION

from service.cli import main

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def langchain_example() -> str:
    """The example's code, but for its last lines (which call a server on the default port)."""
    found = re.search(r"<!-- langchain-retriever -->\n```python\n(.*?)```", API_DOC.read_text(), re.DOTALL)
    assert found is not None, "docs/api.md lost its LangChain retriever example"
    code, usage = found.group(1).split("\n\nretriever = ")
    assert "retriever.invoke(" in usage
    return code


def test_the_langchain_retriever_of_the_docs_and_the_cli_filter(
    live_server: Callable[..., LiveServer], capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(langchain_example(), str(API_DOC), "exec"), namespace)
    retriever_class = namespace["KvstitchRetriever"]
    with live_server(redis_url=None, api_key="retriever-key-0123") as server:
        import httpx

        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer retriever-key-0123"}) as client:
            assert ingest(client, CORPUS)["status"] == "done"
        english = {"must": [{"key": "lang", "match": "en"}]}
        retriever = retriever_class(url=server.url, api_key="retriever-key-0123", top_k=3, filter=english)
        docs = retriever.invoke(QUESTION)
        assert [d.metadata["doc_id"] for d in docs] == ["otters", "volcano"]
        assert docs[0].page_content == CORPUS[0]["text"]
        assert {k: v for k, v in docs[0].metadata.items() if k not in ("doc_id", "score")} == METADATA["otters"]
        assert docs[0].metadata["score"] >= docs[1].metadata["score"]

        french = json.dumps({"must": [{"key": "lang", "match": "fr"}]})
        common = ["ask", "--url", server.url, "--api-key", "retriever-key-0123", "--max-new-tokens", "2"]
        assert main([*common, "--filter", french, QUESTION]) == 0
        assert "[sources: bread (" in capsys.readouterr().out
        nothing = json.dumps({"must": [{"key": "lang", "match": "de"}]})
        assert main([*common, "--filter", nothing, QUESTION]) == 0
        out = capsys.readouterr().out
        assert "[sources: none]\n[no chunk matches the filter: the answer has no sources]" in out
        assert main([*common, "--filter", "{lang: en}", QUESTION]) == 2
        assert "error: --filter is not JSON" in capsys.readouterr().err
        assert main([*common, "--filter", '{"must": []}', QUESTION]) == 1
        assert "filter.must: a non-empty list of conditions" in capsys.readouterr().err
