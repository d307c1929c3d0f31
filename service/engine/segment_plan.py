"""The host side of a segment plan (`segment_launch.SegmentPlan`): its int64 arrays, built with array operations.

Query entries, pairs, tiles and each row's partials, for the by-chunk plan of a decode step and the by-request plan
of a question prefill, and the padding to a `PlanCapacity` that a CUDA graph's captured plan has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.segment_attention import SegmentArrays

# A tile row: arena start and length of its key range, its group's first pair and pair count, its query block.
TILE_COLUMNS = 5
# A by-request tile row: first row and rows, first entry and segments, first segment, split lo .. hi, block, pair.
REQUEST_COLUMNS = 9
# Query items a by-request tile holds (one width: a prefill's requests have many rows each); module-level so a
# benchmark can try others.
REQUEST_BLOCK_M = 64
_MIN_BLOCK_M = 16
# Query items a tile holds at most: a chunk read by more queries is read once per block of them (from L2 after
# the first). 128 would halve those reads but spills registers at 8 warps (ptxas, sm_90, head_dim 128); module-level
# so a benchmark can try it.
MAX_BLOCK_M = 64
# Programs worth having in flight before chunks are cut: about two per SM of an H100.
_TARGET_PROGRAMS = 264
# Programs a by-request plan splits its requests' chunk lists for: a prefill program is long (a request's whole
# chunk list), so a last wave that fills a few SMs leaves the rest idle for a whole program; about four waves of
# resident programs keep that tail short (more partials to merge, a few rows each).
REQUEST_TARGET_PROGRAMS = 1024
_MIN_PIECE = 128


@dataclass(frozen=True)
class PlanCapacity:
    """Fixed sizes of the plans one CUDA graph replays: each step's plan is padded to them (dead rows, entries,
    pairs and tiles do nothing; a dead row's output is zero) and copied into the captured plan's tensors."""

    rows: int
    entries: int
    pairs: int
    chunk_tiles: int  # per tile width (16, 32, ... MAX_BLOCK_M query items); by request: of REQUEST_BLOCK_M
    tail_tiles: int  # per tile width
    segments: int = 0  # by request: the segment table's rows


class HostPlan:
    """The plan's arrays, built on the host with array operations (a Python loop over every (row, segment) pair
    took milliseconds at a few hundred answers, on the critical path of every step): query entries, pairs, tiles
    and each row's partials. Order is part of the contract: entries by row then segment, chunks in the order
    they are first read, readers of a chunk in entry order, then one tail group per request in request order."""

    def __init__(self, batch: SegmentArrays, group: int) -> None:
        self.batch = batch
        self.group = group
        self.rows = batch.rows.size
        self.positions = batch.positions
        self.q_rows = np.zeros(0, dtype=np.int64)
        self.q_positions = np.zeros(0, dtype=np.int64)
        self.pair_q = np.zeros(0, dtype=np.int64)
        self.pair_visible = np.zeros(0, dtype=np.int64)
        self.pair_row = np.zeros(0, dtype=np.int64)  # the row each chunk pair is merged into
        self.row_tail = np.zeros(self.rows, dtype=np.int64)
        # Tiles by the query items they hold: a group of few readers is not padded to the widest group's block.
        self.chunk_tiles: dict[int, np.ndarray] = {}
        self.tail_tiles: dict[int, np.ndarray] = {}
        self.segments = np.zeros((0, 2), dtype=np.int64)  # by request: each segment's arena start and length
        self.by_request = False  # whether `add_requests` planned the chunks (its tiles, its segment table)

    def add_chunks(self, pieces: int | None, kv_heads: int) -> None:
        """A query entry per (row, segment), rotated to m - o + base; a group of pairs per chunk piece (`pieces`
        per chunk; None: `_auto_pieces`)."""
        ranges = self.batch.chunks
        chunk = self._add_entries()
        if chunk.size == 0:
            return
        # Chunks in the order they are first read; each chunk's readers (entries) in entry order.
        ids, first_read = np.unique(chunk, return_index=True)
        ordered = ids[np.argsort(first_read)]
        rank = np.zeros(ranges.shape[0], dtype=np.int64)
        rank[ordered] = np.arange(ordered.size)
        readers_by_chunk = np.argsort(rank[chunk], kind="stable")
        readers = np.bincount(rank[chunk], minlength=ordered.size)
        if pieces is None:
            pieces = _auto_pieces(readers, ranges[ordered, 1], self.group, kv_heads)
        lengths = ranges[ordered, 1]
        cuts = np.maximum(1, np.minimum(pieces, lengths))  # pieces per chunk, none empty (`_cut`)
        group_chunk = _expand(cuts)
        piece = _within(cuts)
        whole = lengths[group_chunk]
        first = whole * piece // cuts[group_chunk]
        size = whole * (piece + 1) // cuts[group_chunk] - first
        group_readers = readers[group_chunk]
        pair_group = _expand(group_readers)
        reader_start = np.concatenate(([0], np.cumsum(readers)[:-1]))
        self.pair_q = readers_by_chunk[reader_start[group_chunk][pair_group] + _within(group_readers)]
        self.pair_visible = size[pair_group]
        self.pair_row = self.q_rows[self.pair_q]
        first_pair = np.concatenate(([0], np.cumsum(group_readers)[:-1]))
        starts = ranges[ordered, 0][group_chunk] + first
        self.chunk_tiles = self._tiles(starts, size, first_pair, group_readers)

    def _add_entries(self) -> np.ndarray:
        """A query entry per (row, segment), by row then segment, rotated to m - o + base; each entry's chunk."""
        batch = self.batch
        counts, rows = batch.seg_counts, batch.rows
        first_segment = np.concatenate(([0], np.cumsum(counts)[:-1]))[rows]  # each row's first segment
        entry_row = _expand(counts[rows])
        segment = first_segment[entry_row] + _within(counts[rows])
        chunk: np.ndarray = batch.seg_chunk[segment]
        self.q_rows = entry_row
        self.q_positions = self.positions[entry_row] - batch.seg_offset[segment] + batch.chunks[chunk, 2]
        return chunk

    def add_requests(self, splits: int | None, kv_heads: int) -> None:
        """By request: the same query entries as `add_chunks`, and a group of pairs per (request, split of its
        segments), one pair per row, whose tiles take REQUEST_BLOCK_M of the request's query items each (`splits`
        None: `auto_splits`). Every segment's arena range goes into the segment table."""
        batch = self.batch
        if (np.diff(batch.rows) < 0).any():
            raise ValueError("a by-request plan needs each request's rows together, in request order")
        self.by_request = True
        self._add_entries()
        self.segments = batch.chunks[batch.seg_chunk, :2]
        requests, row0, n_rows = np.unique(batch.rows, return_index=True, return_counts=True)
        reading = batch.seg_counts[requests] > 0
        requests, row0, n_rows = requests[reading], row0[reading], n_rows[reading]
        if requests.size == 0:
            return
        segments = batch.seg_counts[requests]
        blocks = -(-n_rows * self.group // REQUEST_BLOCK_M)
        if splits is None:
            splits = auto_splits(int(blocks.sum()) * kv_heads, int(segments.max()))
        self._add_request_groups(requests, row0, n_rows, blocks, np.minimum(max(1, splits), segments))

    def _add_request_groups(
        self, requests: np.ndarray, row0: np.ndarray, n_rows: np.ndarray, blocks: np.ndarray, parts: np.ndarray
    ) -> None:
        """The pairs and tiles of each (request, split): request i's rows row0[i] .. + n_rows[i], its query items
        in blocks[i] tiles, its segments in parts[i] splits (lo .. hi - 1 each, request-local)."""
        counts = self.batch.seg_counts
        group_request = _expand(parts)  # a group per (request, split), requests in order
        split = _within(parts)
        size = counts[requests][group_request]
        lo, hi = size * split // parts[group_request], size * (split + 1) // parts[group_request]
        group_rows = n_rows[group_request]
        group_pair0 = np.concatenate(([0], np.cumsum(group_rows)[:-1]))
        row_entries = counts[self.batch.rows]
        entry_first = np.concatenate(([0], np.cumsum(row_entries)[:-1]))  # each row's first entry
        self.pair_row = row0[group_request][_expand(group_rows)] + _within(group_rows)
        self.pair_q = entry_first[self.pair_row]  # unread by the kernel; a valid entry all the same
        self.pair_visible = np.zeros(self.pair_row.size, dtype=np.int64)
        first_segment = np.concatenate(([0], np.cumsum(counts)[:-1]))[requests]
        first_entry = entry_first[row0]
        by_group = [row0, n_rows, first_entry, counts[requests], first_segment]
        by_group = [column[group_request] for column in by_group] + [lo, hi]
        group_blocks = blocks[group_request]
        tile_group = _expand(group_blocks)
        columns = [*(c[tile_group] for c in by_group), _within(group_blocks), group_pair0[tile_group]]
        self.chunk_tiles = {REQUEST_BLOCK_M: np.stack(columns, axis=1)}

    def add_tails(self) -> None:
        """A group per request: its rows, rotated to their own positions, each seeing its causal prefix."""
        batch = self.batch
        if self.rows == 0:
            return
        visible = batch.tail_visible()
        owner = batch.rows
        by_request = np.argsort(owner, kind="stable")  # rows grouped by request, in request then row order
        entries, pairs = self.q_rows.size, self.pair_q.size
        self.q_rows = np.concatenate((self.q_rows, by_request))
        self.q_positions = np.concatenate((self.q_positions, self.positions[by_request]))
        self.pair_q = np.concatenate((self.pair_q, entries + np.arange(self.rows)))
        self.pair_visible = np.concatenate((self.pair_visible, visible[by_request]))
        self.row_tail[by_request] = pairs + np.arange(self.rows)
        requests, first_row, rows_of = np.unique(owner[by_request], return_index=True, return_counts=True)
        seen = np.maximum.reduceat(visible[by_request], first_row)
        starts = batch.tail_start[requests]
        self.tail_tiles = self._tiles(starts, seen, pairs + first_row, rows_of)

    def _tiles(
        self, starts: np.ndarray, lengths: np.ndarray, first_pairs: np.ndarray, readers: np.ndarray
    ) -> dict[int, np.ndarray]:
        """Tile rows [start, length, first pair, pairs, block] per group of pairs, by the width (query items) of
        the blocks that cover each group's items; groups in order within a width."""
        items = readers * self.group
        width = _block_m(items)
        blocks = -(-items // width)
        tile_group = _expand(blocks)
        rows = np.stack(
            (starts[tile_group], lengths[tile_group], first_pairs[tile_group], readers[tile_group], _within(blocks)),
            axis=1,
        )
        tile_width = width[tile_group]
        return {int(w): rows[tile_width == w] for w in np.unique(tile_width)}

    def live_tiles(self, tiles: dict[int, np.ndarray], width: int) -> int:
        """Live tile rows of `tiles[width]` (one of this plan's two dicts): they come first, and a dead row (of a
        padded plan) has no pair (by chunk, a tail) or no row (by request)."""
        column = 1 if tiles is self.chunk_tiles and self.by_request else 3
        return int(np.count_nonzero(tiles[width][:, column]))

    def row_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's chunk pairs, in pair order, flat, and the row pointer into them ([rows + 1])."""
        flat = np.argsort(self.pair_row, kind="stable")
        counts = np.bincount(self.pair_row, minlength=self.rows)
        return flat, np.concatenate(([0], np.cumsum(counts)))

    def pad(self, capacity: PlanCapacity) -> None:
        """Pad every array to `capacity`, with a tile list of each width (dead tiles hold no pair or no row)."""
        sizes = {"rows": self.rows, "entries": self.q_rows.size, "pairs": self.pair_q.size}
        if self.by_request:
            sizes["segments"] = len(self.segments)
        for tiles, name in ((self.chunk_tiles, "chunk_tiles"), (self.tail_tiles, "tail_tiles")):
            sizes[name] = max((len(rows) for rows in tiles.values()), default=0)
        over = [f"{name} {n} > {getattr(capacity, name)}" for name, n in sizes.items() if n > getattr(capacity, name)]
        if over:
            raise ValueError(f"the batch exceeds the plan's capacity: {', '.join(over)}")
        self.row_tail = padded(self.row_tail, capacity.rows, -1)
        self.q_rows = padded(self.q_rows, capacity.entries)
        self.q_positions = padded(self.q_positions, capacity.entries)
        self.pair_q = padded(self.pair_q, capacity.pairs)
        self.pair_visible = padded(self.pair_visible, capacity.pairs)
        self.rows = capacity.rows
        if self.by_request:
            self.segments = np.concatenate(
                (self.segments, np.zeros((capacity.segments - len(self.segments), 2), np.int64))
            )
        by_request = self.by_request
        chunk_widths, chunk_columns = ([REQUEST_BLOCK_M], REQUEST_COLUMNS) if by_request else (_widths(), TILE_COLUMNS)
        _pad_tiles(self.chunk_tiles, capacity.chunk_tiles, chunk_widths, chunk_columns)
        _pad_tiles(self.tail_tiles, capacity.tail_tiles, _widths(), TILE_COLUMNS)


def _pad_tiles(tiles: dict[int, np.ndarray], count: int, widths: list[int], columns: int) -> None:
    """A list of `count` tile rows of each width in `widths`, `tiles`' own first (a dead tile is all zeros)."""
    for width in widths:
        rows = tiles.get(width, np.zeros((0, columns), dtype=np.int64))
        tiles[width] = np.concatenate((rows, np.zeros((count - len(rows), columns), dtype=np.int64)))


def _expand(counts: np.ndarray) -> np.ndarray:
    """i repeated counts[i] times, for every i: [0, 0, 1, 2, 2, 2] for counts [2, 1, 3]."""
    return np.repeat(np.arange(counts.size, dtype=np.int64), counts)


def _within(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[i] - 1 for every i, concatenated: [0, 1, 0, 0, 1, 2] for counts [2, 1, 3]."""
    starts = np.cumsum(counts) - counts
    within: np.ndarray = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    return within


def padded(values: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    padded: np.ndarray = np.concatenate((values, np.full(size - values.size, fill, dtype=np.int64)))
    return padded


def _widths() -> list[int]:
    """Every tile width a plan may use."""
    return [1 << k for k in range(_MIN_BLOCK_M.bit_length() - 1, MAX_BLOCK_M.bit_length())]


def _block_m(items: np.ndarray) -> np.ndarray:
    """The tile width for groups of `items` query items: the next power of two, within _MIN_BLOCK_M..MAX_BLOCK_M."""
    power = np.left_shift(1, np.ceil(np.log2(np.maximum(items, 1))).astype(np.int64))
    width: np.ndarray = np.minimum(MAX_BLOCK_M, np.maximum(_MIN_BLOCK_M, power))
    return width


def auto_splits(programs: int, most_segments: int) -> int:
    """Splits of each request's chunk list so that `programs` (unsplit, all KV heads) reach about
    REQUEST_TARGET_PROGRAMS, at most one chunk a split."""
    return max(1, min(-(-REQUEST_TARGET_PROGRAMS // max(programs, 1)), most_segments))


def _auto_pieces(readers: np.ndarray, lengths: np.ndarray, group: int, kv_heads: int) -> int:
    """Pieces per chunk so that the chunk programs reach about _TARGET_PROGRAMS, no piece under _MIN_PIECE
    (`readers` and `lengths`: per chunk read)."""
    items = readers * group
    programs = kv_heads * int((-(-items // _block_m(items))).sum())
    return max(1, min(-(-_TARGET_PROGRAMS // programs), int(lengths.max()) // _MIN_PIECE))
