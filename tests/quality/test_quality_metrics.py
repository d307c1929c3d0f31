"""Answer metrics: SQuAD normalisation, whole-word containment, token F1 and KL on known distributions."""

from __future__ import annotations

import math

import pytest
import torch

from service.quality.metrics import (
    EXTRA_WORDS,
    answer_span,
    best_f1,
    contains_answer,
    kl_divergence,
    normalize_answer,
    short_answer_correct,
    token_f1,
)


@pytest.mark.parametrize(
    ("text", "normalised"),
    [
        ("The Quick, brown FOX!", "quick brown fox"),
        ("an apple a day", "apple day"),
        ("  A   theory\n of  everything. ", "theory of everything"),
        ("Theatre anathema", "theatre anathema"),  # articles only as whole words
        ("1,873", "1873"),  # punctuation dropped, not replaced by a space (as in SQuAD)
        ("The", ""),
    ],
)
def test_normalisation_follows_squad(text: str, normalised: str) -> None:
    assert normalize_answer(text) == normalised


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("He was born in 1873.", ["1873"], True),
        ("Born in Ommeria, 1873", ["ommeria"], True),
        ("ZORVATH KEEL!", ["Zorvath Keel"], True),
        ("It was the Zorvath Keel.", ["a zorvath keel"], True),  # articles on either side do not matter
        ("born in 18735", ["1873"], False),  # whole words only
        ("Ommeria", ["in"], False),
        ("nothing here", ["1873", "here"], True),  # any acceptable answer counts
        ("nothing here", ["1873", "Ommeria"], False),
        ("anything", ["the"], False),  # an answer that normalises to nothing never matches
    ],
)
def test_containment_accuracy(prediction: str, answers: list[str], expected: bool) -> None:
    assert contains_answer(prediction, answers) is expected


def test_token_f1_on_known_overlaps() -> None:
    # prediction {cat, sat}, gold {cat, sat, down}: precision 1, recall 2/3, F1 0.8
    assert token_f1("The cat sat", "cat sat down") == pytest.approx(0.8)
    assert token_f1("cat", "dog") == 0.0
    assert token_f1("The Cat.", "cat") == 1.0
    # repeated tokens count once per occurrence on both sides: common = min(2, 1) = 1
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("the", "cat") == 0.0


def test_best_f1_takes_the_best_answer() -> None:
    assert best_f1("born in 1873", ["Ommeria", "1873"]) == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert best_f1("Ommeria", ["Ommeria", "1873"]) == 1.0


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_on_known_distributions() -> None:
    p, q = [0.5, 0.5], [0.9, 0.1]
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(_logits(p), _logits(q)) == pytest.approx(expected, rel=1e-12)
    # asymmetric: KL(Q || P) is another number
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(_logits(q), _logits(p)) == pytest.approx(reverse, rel=1e-12)
    assert expected != pytest.approx(reverse)


def test_kl_is_invariant_to_logit_shifts_and_zero_for_equal_distributions() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    assert kl_divergence(logits, logits + 7.0) == 0.0
    assert kl_divergence(logits, logits.flip(0)) > 0.1


def test_kl_ignores_tokens_the_reference_gives_no_mass() -> None:
    p = torch.tensor([0.0, float("-inf")])  # P = [1, 0]
    q = _logits([0.25, 0.75])
    assert kl_divergence(p, q) == pytest.approx(math.log(1 / 0.25))
    assert kl_divergence(p, p) == 0.0


@pytest.mark.parametrize(
    ("prediction", "span"),
    [
        ("1873", "1873"),
        ("He was born in 1873. Later he moved.", "He was born in 1873."),
        ("\n\n  Ommeria\nbecause the passage says so", "Ommeria"),
        ("Python 3.11 and v1.2 are versions", "Python 3.11 and v1.2 are versions"),  # no sentence end in a number
        ("Yes! It is.", "Yes!"),
        ("Why? Because.", "Why?"),
        ("", ""),
    ],
)
def test_the_answer_span_is_the_first_statement(prediction: str, span: str) -> None:
    assert answer_span(prediction) == span


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("1873", ["1873"], True),
        ("He was born in 1873.", ["1873"], True),
        ("1873. Later he moved to Ommeria and lived there for many long and happy years.", ["1873"], True),
        ("The default value of the indent argument is None", ["None"], True),  # 6 extra normalised words: the limit
        ("The default value of this indent argument is None", ["None"], False),  # 7 extra
        ("Zorvath Keel, a sculptor", ["Zorvath Keel"], True),
        # a copied sentence around the span is not an answer to the question
        ("In 1873 the observatory was founded by Gouxbriar Brath on the hill above Ommeria", ["1873"], False),
        ("Ommeria. He was born in 1873.", ["1873"], False),  # the span is not in the first statement
        ("I think the documents say\n1873", ["1873"], False),  # nor on the first line
        ("born in 18735", ["1873"], False),  # whole words, as containment
        ("Born in Ommeria in 1873", ["Ommeria", "1873"], True),  # any acceptable answer counts
        # a longer gold answer allows a longer restatement
        ("It is released under the GNU General Public License version 3", ["GNU General Public License"], True),
    ],
)
def test_short_answer_rule(prediction: str, answers: list[str], expected: bool) -> None:
    assert short_answer_correct(prediction, answers) is expected
    assert contains_answer(prediction, answers) or not expected  # stricter than containment, never laxer


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("The default maximum line width of fmt is 75.", True),  # the question restated around the answer
        ("The default maximum line width of fmt is 75 columns wide on most terminals people use today.", False),
        ("It is 75.", True),
        ("The documents say that the default maximum line width is 75 columns wide in most cases here.", False),
    ],
)
def test_words_of_the_question_do_not_count_as_padding(prediction: str, expected: bool) -> None:
    question = "What is the default maximum line width of fmt?"
    assert short_answer_correct(prediction, ["75"], question) is expected
    assert not short_answer_correct("The default maximum line width of fmt is 75.", ["75"])  # without the question


def test_the_extra_word_limit_is_the_documented_six() -> None:
    assert EXTRA_WORDS == 6
    assert short_answer_correct("one two three four five six 1873", ["1873"])
    assert not short_answer_correct("one two three four five six seven 1873", ["1873"])
