"""The retriever examples of docs/api.md (LangChain, LlamaIndex), run as written against the real app under uvicorn,
and the command line's `kvstitch ask --filter` against the same server."""

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


def docs_example(marker: str, call: str) -> str:
    """The code of the example after `<!-- marker -->`, but for its last lines (which call a server on the default
    port, with `call`)."""
    found = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", API_DOC.read_text(), re.DOTALL)
    assert found is not None, f"docs/api.md lost its {marker} example"
    code, usage = found.group(1).split("\n\nretriever = ")
    assert call in usage
    return code


def retriever_class(marker: str, call: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(docs_example(marker, call), str(API_DOC), "exec"), namespace)
    return namespace["KvstitchRetriever"]


def test_the_retrievers_of_the_docs_and_the_cli_filter(
    live_server: Callable[..., LiveServer], capsys: pytest.CaptureFixture[str]
) -> None:
    langchain = retriever_class("langchain-retriever", "retriever.invoke(")
    llamaindex = retriever_class("llamaindex-retriever", "retriever.retrieve(")
    with live_server(redis_url=None, api_key="retriever-key-0123") as server:
        import httpx

        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer retriever-key-0123"}) as client:
            assert ingest(client, CORPUS)["status"] == "done"
        english = {"must": [{"key": "lang", "match": "en"}]}
        retriever = langchain(url=server.url, api_key="retriever-key-0123", top_k=3, filter=english)
        docs = retriever.invoke(QUESTION)
        assert [d.metadata["doc_id"] for d in docs] == ["otters", "volcano"]
        assert docs[0].page_content == CORPUS[0]["text"]
        assert {k: v for k, v in docs[0].metadata.items() if k not in ("doc_id", "score")} == METADATA["otters"]
        assert docs[0].metadata["score"] >= docs[1].metadata["score"]

        nodes = llamaindex(url=server.url, api_key="retriever-key-0123", top_k=3, filter=english).retrieve(QUESTION)
        assert [n.node.metadata["doc_id"] for n in nodes] == ["otters", "volcano"]
        assert nodes[0].node.get_content() == CORPUS[0]["text"]
        assert [n.score for n in nodes] == [d.metadata["score"] for d in docs]  # the same /retrieve answer

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
