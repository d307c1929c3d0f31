"""The chat page's source names: a link only to an http(s) URL from the document's metadata, opening with
rel=noopener, its text set as text (never markup). Runs app.js's own functions under Node with a stand-in document
that records what the page builds."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

APP_JS = Path(__file__).resolve().parent.parent / "service" / "api" / "static" / "app.js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js runs the page's script (apt-get install -y nodejs)")

# A stand-in `document.createElement`: elements record their tag, attributes and text; `innerHTML` throws, so a
# rendering through markup fails the test.
SCRIPT = """
const page = require(process.argv[1]);
const fakeDocument = {
  createElement(tag) {
    const element = { tag, attributes: {}, className: "", textContent: "",
      setAttribute(name, value) { this.attributes[name] = String(value); } };
    Object.defineProperty(element, "innerHTML", { set() { throw new Error("innerHTML used"); } });
    return element;
  },
};
const sources = JSON.parse(process.argv[2]);
const out = sources.map((c) => {
  const e = page.sourceName(fakeDocument, c);
  return { link: page.sourceLink(c), tag: e.tag, text: e.textContent, attributes: e.attributes, cls: e.className };
});
process.stdout.write(JSON.stringify(out));
"""


def rendered(sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert NODE is not None
    done = subprocess.run(
        [NODE, "-e", SCRIPT, str(APP_JS), json.dumps(sources)], capture_output=True, text=True, check=True, timeout=60
    )
    result: list[dict[str, Any]] = json.loads(done.stdout)
    return result


def test_a_source_with_an_http_url_is_a_link_and_others_are_text() -> None:
    sources = [
        {"doc_id": "otters", "metadata": {"url": "https://example.org/otters?a=1&b=<2>", "title": "Otters <b>"}},
        {"doc_id": "plain", "metadata": {"url": "http://example.org/p"}},
        {"doc_id": "js", "metadata": {"url": "javascript:alert(1)", "title": "evil"}},
        {"doc_id": "data", "metadata": {"url": "data:text/html,<script>alert(1)</script>"}},
        {"doc_id": "relative", "metadata": {"url": "/etc/passwd"}},
        {"doc_id": "number", "metadata": {"url": 42}},
        {"doc_id": "none"},
    ]
    out = rendered(sources)
    assert out[0] == {
        "link": "https://example.org/otters?a=1&b=%3C2%3E",
        "tag": "a",
        "text": "Otters <b>",  # the title as text: the angle brackets stay characters
        "attributes": {
            "href": "https://example.org/otters?a=1&b=%3C2%3E",
            "target": "_blank",
            "rel": "noopener noreferrer",
            "title": "otters",
        },
        "cls": "doc-id",
    }
    assert (out[1]["tag"], out[1]["text"], out[1]["attributes"]["href"]) == ("a", "plain", "http://example.org/p")
    for item, source in zip(out[2:], sources[2:], strict=True):
        assert item == {"link": None, "tag": "span", "text": source["doc_id"], "attributes": {}, "cls": "doc-id"}


def test_the_page_builds_no_markup_from_strings() -> None:
    assert "innerHTML" not in APP_JS.read_text()
    assert "insertAdjacentHTML" not in APP_JS.read_text()
