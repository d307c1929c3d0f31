"""Retrieval for a conversation: what its searches look for, and how their rankings become one.

A follow-up needs the earlier turn when it names its subject only there ("and what is its second argument?"), and
must not carry it when it changes topic ("what does json.dumps do with sort_keys?" after a question about curl):
embedded together, the earlier turn pulls the search back to the old topic. So a conversation runs two searches,
the last question alone and the question after the earlier user turns, and fuses the two rankings by reciprocal
rank (RRF): a chunk either search ranks near the top stays near the top, one both rank high rises above both.
Two searches whatever the length of the conversation, so the cost is bounded.

The hybrid (dense + sparse) fusion happens inside Qdrant, on its own points; this one fuses the service's hits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from service.retrieval.collection import RetrievedChunk

# The constant of Cormack, Clarke and Buettcher's RRF: large enough that the first few ranks of one list do not
# swamp a chunk both lists rank a little lower.
RRF_K = 60


def conversation_queries(question: str, earlier_user_turns: Sequence[str]) -> tuple[str, ...]:
    """The texts a question's searches embed: the question alone, then (when there are earlier user turns) the
    question after them, one turn a line."""
    if not earlier_user_turns:
        return (question,)
    return question, "\n".join([*earlier_user_turns, question])


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[RetrievedChunk]], limit: int, k: int = RRF_K
) -> list[RetrievedChunk]:
    """The chunks of the rankings (each best first) ordered by the sum over rankings of 1 / (k + rank), rank from
    1, each carrying that sum as its score; the first `limit`. Equal sums keep the order in which the chunks were
    first met reading the rankings rank by rank (the first ranking first), so a tie goes to the better rank."""
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    if k < 0:
        raise ValueError(f"k must not be negative, got {k}")
    scores: dict[str, float] = {}
    chunks: dict[str, RetrievedChunk] = {}
    for rank in range(max((len(r) for r in rankings), default=0)):
        for ranking in rankings:
            if rank < len(ranking):
                hit = ranking[rank]
                chunks.setdefault(hit.id, hit)
                scores[hit.id] = scores.get(hit.id, 0.0) + 1.0 / (k + rank + 1)
    best = sorted(scores, key=lambda chunk_id: -scores[chunk_id])[:limit]  # stable: ties keep first-met order
    return [dataclasses.replace(chunks[i], score=scores[i]) for i in best]
