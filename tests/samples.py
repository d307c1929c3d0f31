"""Real files made in the tests: a multi-page PDF with a text layer (fpdf2) and an HTML page with scripts."""

from __future__ import annotations

from collections.abc import Sequence

from fpdf import FPDF

OTTER_PAGES = (
    "Sea otters hold hands while they sleep so that they do not drift apart on the current.",
    "Otters eat sea urchins, clams and crabs, cracking the shells open with a stone.",
    "Kelp forests shelter otter pups; a mother wraps her pup in kelp before she dives.",
)
OTTER_TITLE = "Otter Field Guide"

HARBOUR_HTML = """<!DOCTYPE html>
<html><head><title>Harbour Seals</title>
<style>.hidden { color: red } /* styleSecret */</style>
<script>var scriptSecret = "never indexed";</script></head>
<body><nav>Home | About</nav>
<h1>Harbour seals</h1>
<p>Harbour seals rest on <b>sandbanks</b> at low tide.<script>alert("scriptSecret")</script></p>
<h2>Diving</h2>
<p>A harbour seal can dive for up to thirty minutes and reach a depth of five hundred metres.</p>
<ul><li>Pups swim within hours of birth.</li><li>Adults weigh about a hundred kilograms.</li></ul>
<noscript>Enable JavaScript</noscript>
</body></html>
"""


def make_pdf(pages: Sequence[str] = OTTER_PAGES, title: str | None = OTTER_TITLE) -> bytes:
    """A PDF with one page per text, drawn with a standard font (a real text layer), and a metadata title."""
    pdf = FPDF()
    if title is not None:
        pdf.set_title(title)
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 10, text)
    return bytes(pdf.output())
