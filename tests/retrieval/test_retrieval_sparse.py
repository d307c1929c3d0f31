"""BM25-style sparse vectors: terms, stable indices, saturated weights."""

from __future__ import annotations

import pytest

from service.retrieval.sparse import AVERAGE_TERMS, K1, document_vector, query_vector, term_index, terms


def test_terms_are_lowercase_ascii_words_and_digits() -> None:
    assert terms("The Licence, the 2nd: GPL-3.0") == {"the": 2, "licence": 1, "2nd": 1, "gpl": 1, "3": 1, "0": 1}


def test_term_indices_never_change() -> None:
    # Stored points hold these indices: a change of hash would make every stored sparse vector unmatched.
    assert (term_index("cat"), term_index("licence")) == (3138554730, 2360743044)


def test_a_question_holds_each_term_once_with_weight_one() -> None:
    question = query_vector("Cat cat dog?")
    assert question.indices == sorted([term_index("cat"), term_index("dog")])
    assert question.values == [1.0, 1.0]
    assert query_vector("?!").indices == []


def test_a_document_weighs_repeated_terms_with_saturation() -> None:
    vector = document_vector("cat cat dog")
    weights = dict(zip(vector.indices, vector.values, strict=True))
    norm = K1 * (0.25 + 0.75 * 3 / AVERAGE_TERMS)
    assert weights[term_index("cat")] == pytest.approx(2 * 2.2 / (2 + norm))
    assert weights[term_index("dog")] == pytest.approx(2.2 / (1 + norm))
    assert weights[term_index("dog")] < weights[term_index("cat")] < 2 * weights[term_index("dog")]
    assert vector.indices == sorted(vector.indices)
