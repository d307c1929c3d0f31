"""Answer metrics: SQuAD-style normalisation, short-answer accuracy, containment, token F1, and first-token KL.

Normalisation follows the SQuAD v1.1 evaluation script (lowercase, drop punctuation, drop the articles a/an/the,
collapse whitespace), so numbers are comparable with the papers that report it.

Accuracy (`short_answer_correct`) does not reward a wordy answer that merely contains the span. The answer is cut
to its first statement (`answer_span`: the first non-blank line, up to the first `.`, `!` or `?` followed by a space
or the end); it is correct when that span holds an acceptable answer as whole words (normalised) and has at most
`EXTRA_WORDS` normalised words more than that answer, not counting words of the question (an answer that restates
the question, "The default width of fmt is 75." for "What is the default width of fmt?", is a short answer; a small
instruct model answers so even when told not to). "1873", "He was born in 1873." and "1873. Later he moved to
Ommeria." are correct for "1873"; a copied sentence of fifteen words around it, "Ommeria. He was born in 1873."
and an answer on its second line are not. F1 is scored on the same first statement. `contains_answer` (anywhere in
the text, any length: the accuracy of Block-Attention and TurboRAG) is kept as the lenient figure beside them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
# "The default value of the indent argument is None" (7 normalised words) passes for "None"; a copied sentence fails.
EXTRA_WORDS = 6
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """lowercase → no punctuation → no articles → single spaces (the SQuAD order)."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def contains_answer(prediction: str, answers: Sequence[str]) -> bool:
    """Whether the normalised prediction holds a normalised acceptable answer as whole words.

    Whole words (not a raw substring) so that "187" does not match inside "1873", nor "in" inside "ommeria".
    An answer that normalises to nothing never matches (it would match every prediction).
    """
    padded = f" {normalize_answer(prediction)} "
    return any(norm and f" {norm} " in padded for norm in map(normalize_answer, answers))


def answer_span(prediction: str) -> str:
    """The answer's first statement: its first non-blank line, cut after the first sentence end ("3.11" and
    "v1.2" are not sentence ends: the mark must be followed by whitespace or the end)."""
    line = next((line for line in prediction.splitlines() if line.strip()), "")
    end = _SENTENCE_END.search(line)
    return (line[: end.end()] if end else line).strip()


def short_answer_correct(prediction: str, answers: Sequence[str], question: str = "") -> bool:
    """The module's accuracy rule: the first statement holds an acceptable answer and has at most `EXTRA_WORDS`
    normalised words more than it, words of `question` not counted."""
    span = answer_span(prediction)
    asked = set(normalize_answer(question).split())
    length = sum(1 for word in normalize_answer(span).split() if word not in asked)
    return any(
        contains_answer(span, [answer]) and length <= len(normalize_answer(answer).split()) + EXTRA_WORDS
        for answer in answers
    )


def token_f1(prediction: str, answer: str) -> float:
    """SQuAD token F1 of two texts after normalisation (1.0 when both normalise to nothing)."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not predicted or not gold:
        return float(predicted == gold)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    """F1 against the best-matching acceptable answer."""
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P || Q) in nats, P = softmax(reference_logits), Q = softmax(logits), both [vocab].

    Computed in float64 from log-softmax so near-identical distributions give ~0 rather than rounding noise, and
    clamped at 0 (the true value is never negative; float error can make it -1e-17).
    """
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    terms = log_p.exp() * (log_p - log_q)
    # A token P gives no mass to contributes 0, even where Q gives it none either (0 * (-inf - -inf) = nan).
    kl = float(torch.where(torch.isneginf(log_p), torch.zeros_like(terms), terms).sum())
    return max(kl, 0.0)
