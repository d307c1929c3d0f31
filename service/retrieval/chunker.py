"""Token-aware chunking: a document becomes chunks of at most `chunk_size` tokens of the LLM's own tokenizer.

Each chunk is a span of the original text (`text == original[char_start:char_end]`) that neither starts nor ends
with whitespace, and carries the ids of its text tokenized alone. Those ids are exactly what the KV precompute
caches and what the gateway wraps into a block, so nothing downstream ever re-tokenizes a joined string.

Cutting is greedy: from a chunk's start, the token budget decides how far the chunk may reach, and the chunk ends
at the best-ranked cut point in that reach (heading > paragraph > sentence > line > word), the latest one of that
rank; only a run without whitespace longer than the budget is cut at a token boundary. A chunk is never headings
alone: the gap after a heading ranks as a line break, and a piece that would still be only headings takes the next
cut instead (`headings.py` finds Markdown headings and plain text's numbered and stand-alone titles). The
document's tokens are read once with their character offsets to estimate every span's token count; each chunk
is then encoded alone and shrunk if the estimate was short, so the limit holds exactly.

Overlap: when a cut falls inside a paragraph (a sentence, line or word cut), the next chunk repeats the last
whole units of the same rank or better that fit in `overlap` tokens, so a thought cut in two keeps its context.
A cut at a paragraph or heading leaves nothing unfinished and is not overlapped, which keeps duplicated KV
small. No text is ever in more than two chunks.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from service.engine.kv_layout import TokenIds
from service.engine.prompt import encode_text, text_tokenizer
from service.retrieval.boundaries import CutPoint, Rank, Span, find_cut_points
from service.retrieval.headings import is_heading_only

# Below this a budget cannot hold even a few words plus the edge effects of tokenizing a span alone.
MIN_CHUNK_SIZE = 16
DEFAULT_MAX_DOCUMENT_CHARS = 2_000_000
COUNT_BATCH = 32  # texts per tokenizer call when counting a job's tokens (the fast tokenizer batches in Rust)
_END_OF_TEXT = max(Rank) + 1  # ranks a final piece above any cut: it needs none


@dataclass(frozen=True)
class ChunkerConfig:
    """Chunk size and overlap in tokens of the LLM's tokenizer, and the largest document accepted."""

    chunk_size: int = 384
    overlap: int = 48
    max_document_chars: int = DEFAULT_MAX_DOCUMENT_CHARS

    def __post_init__(self) -> None:
        if self.chunk_size < MIN_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be at least {MIN_CHUNK_SIZE} tokens, got {self.chunk_size}")
        if not 0 <= self.overlap <= self.chunk_size // 2:
            raise ValueError(
                f"overlap must be between 0 and chunk_size // 2 = {self.chunk_size // 2}, got {self.overlap}"
            )
        if self.max_document_chars < 1:
            raise ValueError(f"max_document_chars must be positive, got {self.max_document_chars}")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a document: its span in the original text and the ids of that text tokenized alone."""

    doc_id: str
    index: int
    char_start: int
    char_end: int
    text: str
    token_ids: TokenIds

    @property
    def token_count(self) -> int:
        return len(self.token_ids)


class Chunker:
    """Cuts plain text or Markdown into `Chunk`s; deterministic for a given tokenizer and config."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ChunkerConfig | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the chunker needs a fast (Rust-backed) tokenizer: it reads token character offsets")
        self.tokenizer = tokenizer
        self.config = config or ChunkerConfig()

    def chunk(self, doc_id: str, text: str, *, markdown: bool = False) -> list[Chunk]:
        """The document's chunks in text order; none for empty or whitespace-only text (the caller reports it)."""
        self._check_size(doc_id, text)
        if not text.strip():
            return []
        encode = functools.partial(encode_text, self.tokenizer)
        packer = _Packer(text, encode, self._token_offsets(text), self.config, markdown)
        return [
            Chunk(doc_id, i, p.start, p.end, text[p.start : p.end], p.token_ids) for i, p in enumerate(packer.pieces())
        ]

    def count_tokens(self, texts: Sequence[str], stop_above: int) -> int:
        """Tokens of the texts (no special tokens), counted a few texts at a time and stopping as soon as the
        total passes `stop_above` (a job over its bound is refused without tokenizing all of it)."""
        total = 0
        for start in range(0, len(texts), COUNT_BATCH):
            batch = list(texts[start : start + COUNT_BATCH])
            encoded = text_tokenizer(self.tokenizer).encode_batch(batch, add_special_tokens=False)
            total += sum(len(e.ids) for e in encoded)
            if total > stop_above:
                break
        return total

    def _check_size(self, doc_id: str, text: str) -> None:
        limit = self.config.max_document_chars
        if len(text) > limit:
            raise ValueError(
                f"document {doc_id!r} has {len(text):,} characters; the limit is {limit:,} (max_document_chars)"
            )

    def _token_offsets(self, text: str) -> _TokenOffsets:
        # The ids `encode_text` gives the chunks: a special token's string counts as the several tokens it becomes.
        encoded = text_tokenizer(self.tokenizer).encode(text, add_special_tokens=False)
        return _TokenOffsets([(int(s), int(e)) for s, e in encoded.offsets], len(text))


class _TokenOffsets:
    """Character offsets of the document's tokens, for estimating the token count of any span.

    A span tokenized alone can differ from the document's tokens at its two edges, so estimates only steer the
    search; every chunk is checked by encoding it.
    """

    def __init__(self, offsets: Sequence[tuple[int, int]], text_length: int) -> None:
        # Running maxima keep both lists sorted for bisect even where multi-byte characters split oddly.
        self.starts = list(itertools.accumulate((s for s, _ in offsets), max))
        self.ends = list(itertools.accumulate((e for _, e in offsets), max))
        self.text_length = text_length

    def count(self, start: int, end: int) -> int:
        """Tokens overlapping [start, end)."""
        return max(0, bisect.bisect_left(self.starts, end) - bisect.bisect_right(self.ends, start))

    def reach(self, start: int, budget: int) -> int:
        """The furthest end such that [start, end) holds about `budget` tokens (the text's length if all fit)."""
        after_budget = bisect.bisect_right(self.ends, start) + budget
        return self.starts[after_budget] if after_budget < len(self.starts) else self.text_length

    def earliest_start(self, end: int, budget: int) -> int:
        """The earliest start such that [start, end) holds about `budget` tokens."""
        before_budget = bisect.bisect_left(self.starts, end) - budget - 1
        return self.ends[before_budget] if before_budget >= 0 else 0

    def starts_within(self, floor: int, hi: int) -> Iterator[int]:
        """Token start offsets in (floor, hi], latest first."""
        i = bisect.bisect_right(self.starts, hi) - 1
        while i >= 0 and self.starts[i] > floor:
            yield self.starts[i]
            i -= 1


class _CutIndex:
    """The document's cut points, searchable by rank and position."""

    def __init__(self, points: Sequence[CutPoint]) -> None:
        self._by_rank = {rank: [p for p in points if p.rank == rank] for rank in Rank}
        self._starts = {rank: [p.start for p in ps] for rank, ps in self._by_rank.items()}
        self._ends = {rank: [p.end for p in ps] for rank, ps in self._by_rank.items()}

    def best(self, floor: int, hi: int) -> CutPoint | None:
        """The best-ranked cut point starting in (floor, hi]; the latest one of that rank fills the chunk most."""
        for rank in sorted(Rank, reverse=True):
            i = bisect.bisect_right(self._starts[rank], hi) - 1
            if i >= 0 and self._starts[rank][i] > floor:
                return self._by_rank[rank][i]
        return None

    def earliest(self, after: int, min_end: int, before: int, min_rank: Rank) -> CutPoint | None:
        """The cut point ranked `min_rank` or better with start > after and min_end <= end < before, earliest."""
        found: CutPoint | None = None
        for rank in (r for r in Rank if r >= min_rank):
            starts, ends = self._starts[rank], self._ends[rank]
            i = max(bisect.bisect_right(starts, after), bisect.bisect_left(ends, min_end))
            if i < len(ends) and ends[i] < before and (found is None or ends[i] < found.end):
                found = self._by_rank[rank][i]
        return found


@dataclass(frozen=True)
class _Piece:
    """A chunk before it is numbered: [start, end), its ids, and the cut after it (None at the text's end)."""

    start: int
    end: int
    token_ids: TokenIds
    cut: CutPoint | None

    @property
    def rank(self) -> int:
        return _END_OF_TEXT if self.cut is None else int(self.cut.rank)


class _Packer:
    """Lays chunks over one document, left to right."""

    def __init__(
        self,
        text: str,
        encode_text: Callable[[str], TokenIds],
        tokens: _TokenOffsets,
        config: ChunkerConfig,
        markdown: bool,
    ) -> None:
        self.text = text
        self.encode = encode_text
        self.tokens = tokens
        self.size = config.chunk_size
        self.overlap = config.overlap
        self.markdown = markdown
        self.content_start = len(text) - len(text.lstrip())
        self.content_end = len(text.rstrip())
        self.cuts = _CutIndex(find_cut_points(text, markdown=markdown, keep_whole=self._fits))

    def pieces(self) -> Iterator[_Piece]:
        # `floor`: where the next chunk would start without overlap; its cut must lie beyond it to make progress.
        start = floor = self.content_start
        while True:
            piece = self._fit(start, floor)
            yield piece
            if piece.cut is None:
                return
            start = self._overlap_start(piece, piece.cut, floor)
            floor = piece.cut.end

    def _fits(self, span: Span) -> bool:
        """Whether a span fits one chunk (the estimate first: an unclosed fence may run to a large text's end)."""
        if self.tokens.count(span.start, span.end) > 2 * self.size:
            return False
        return len(self.encode(self.text[span.start : span.end])) <= self.size

    def _fit(self, start: int, floor: int) -> _Piece:
        piece = self._fit_from(start, floor)
        if start < floor and (piece is None or piece.rank <= Rank.TOKEN):
            # The overlap left no room for a clean cut (a long word, a code block kept whole): drop it.
            fresh = self._fit_from(floor, floor)
            if fresh is not None and (piece is None or fresh.rank > piece.rank):
                piece = fresh
        return piece or self._smallest_piece(floor)

    def _fit_from(self, start: int, floor: int) -> _Piece | None:
        """The chunk from `start` with its cut beyond `floor`, or None when no cut fits the budget."""
        budget = self.size
        while budget > 0:
            hi = self.tokens.reach(start, budget)
            cut = None if hi >= self.content_end else self.cuts.best(floor, hi) or self._token_cut(floor, hi)
            if hi < self.content_end and cut is None:
                return None
            cut = self._past_headings(start, cut, hi)
            end = self.content_end if cut is None else cut.start
            ids = self.encode(self.text[start:end])
            if len(ids) <= self.size:
                return _Piece(start, end, ids, cut)
            budget -= len(ids) - self.size  # the estimate was short by about this much
        return None

    def _past_headings(self, start: int, cut: CutPoint | None, hi: int) -> CutPoint | None:
        """A later cut when the piece up to `cut` would be headings only (a heading joins the text under it);
        the ranks already keep headings with their text, this holds where no better cut was in reach."""
        while cut is not None and is_heading_only(self.text[start : cut.start], self.markdown):
            later = self.cuts.best(cut.start, hi)
            if later is None:
                return cut
            cut = later
        return cut

    def _token_cut(self, floor: int, hi: int) -> CutPoint | None:
        """The latest token boundary in (floor, hi] inside a run without whitespace: the last resort."""
        for pos in self.tokens.starts_within(floor, hi):
            if not (self.text[pos - 1].isspace() or self.text[pos].isspace()):
                return CutPoint(pos, pos, Rank.TOKEN)
        return None

    def _smallest_piece(self, start: int) -> _Piece:
        """One character: progress when no budget-sized piece could be found (a tokenizer far off its offsets)."""
        end = start + 1
        if end >= self.content_end:
            return _Piece(start, self.content_end, self.encode(self.text[start : self.content_end]), None)
        resume = end + len(self.text[end:]) - len(self.text[end:].lstrip())
        return _Piece(start, end, self.encode(self.text[start:end]), CutPoint(end, resume, Rank.TOKEN))

    def _overlap_start(self, piece: _Piece, cut: CutPoint, floor: int) -> int:
        """Where the next chunk starts: earlier than the cut when a cut inside a paragraph deserves overlap."""
        if self.overlap == 0 or cut.rank >= Rank.PARAGRAPH:
            return cut.end
        min_rank = max(cut.rank, Rank.WORD)  # whole units of the kind that was cut; never half a word
        min_end = self.tokens.earliest_start(piece.end, self.overlap)
        # Starting beyond `floor` keeps text out of a third chunk: before it lies this piece's own overlap.
        while (point := self.cuts.earliest(floor, min_end, piece.end, min_rank)) is not None:
            if len(self.encode(self.text[point.end : piece.end])) <= self.overlap:
                return point.end
            min_end = point.end + 1
        return cut.end
