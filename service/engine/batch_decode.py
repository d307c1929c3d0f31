"""One decode step for B running requests whose KV lives in slabs of one `KVPool`.

Each request feeds one token at its own position; q/k/v, the MLP and the LM head run as one [B, hidden] matmul
each through `LeanForward.layers_static` (the very per-layer code the CUDA graphs capture, over the pool's
tensor instead of one buffer), K/V land in each request's slab at its next slot, and only the attention is per
request: every row attends to the live slots of its own slab and nothing else.

Attention backends:
- `loop` (the CPU's): one `attend_causal_end` per request over its live slice, the kernel `extend` uses, so a
  batched step agrees with the single-sequence step to float rounding. Reads nothing outside the live slots.
- `flash_varlen` (CUDA, fp16/bf16): one flash varlen call, `cu_seqlens_k` holding the slab starts and
  `seqused_k` the live lengths, so flash reads exactly the live keys of every request (a slab's start is all
  flash needs from `cu_seqlens_k` once `seqused_k` is given).
- `sdpa_gather` (CUDA fallback, and testable on the CPU): the live K/V gathered into a padded [B, Hkv, M, D],
  padding zeroed (poisoned NaN slots never reach the kernel) and masked; static shapes for a given M.
`resolve_batch_attention("auto")` picks loop on the CPU, flash where it runs and agrees with the loop on a probe
whose dead slots hold NaN, else sdpa_gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.attention import (
    FLASH_VARLEN,
    StaticAttend,
    attend_causal_end,
    extend_split,
    extend_splits,
    flash_if_it_agrees,
    flash_varlen,
)
from service.engine.device_copy import to_device
from service.engine.forward import LeanForward
from service.engine.kv_layout import ModelSpec
from service.engine.kv_pool import KVPool

LOOP = "loop"
SDPA_GATHER = "sdpa_gather"
BATCH_ATTENTION = (LOOP, FLASH_VARLEN, SDPA_GATHER)


@dataclass(frozen=True)
class StepFeed:
    """Where a decode step's ids come from when picks have not reached the host yet (the overlapped step,
    scheduler.py): row b feeds `picks[src[b]]` where src[b] >= 0, else its host id (a token the host has read)."""

    picks: torch.Tensor  # [P] int64 on the device: the unread picks (the previous step's, admitted first tokens)
    src: tuple[int, ...]  # per row of this step: its index in `picks`, or -1


def fed_ids(host_ids: torch.Tensor, src: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """Per row, picks[src] where src >= 0, else the host id (device tensors; nothing waits for the picks)."""
    return torch.where(src >= 0, picks[src.clamp(min=0)], host_ids)


@dataclass(frozen=True)
class DecodeRows:
    """Inputs of one batched step, one row per request: device tensors for the kernels, host spans for the
    per-request loop and for sizing."""

    ids: torch.Tensor  # [B] the token each request feeds
    positions: torch.Tensor  # [B] its rotary position
    starts: torch.Tensor  # [B] the slab's first slot in the pool
    used: torch.Tensor  # [B] live slots after this step (the fed token included)
    spans: tuple[tuple[int, int], ...]  # (start, used) per row, on the host

    @classmethod
    def build(
        cls,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        device: torch.device,
        feed: StepFeed | None = None,
    ) -> DecodeRows:
        """From host lists; with `feed`, the rows it names take their id from the previous step's picks."""
        if not len(ids) == len(positions) == len(spans) > 0:
            raise ValueError("a decode step needs one id, position and span per request, and one request at least")
        src = list(feed.src) if feed is not None else [-1] * len(ids)
        if len(src) != len(ids):
            raise ValueError("a step's feed needs one source per row")
        host = torch.tensor([list(ids), list(positions), [s for s, _ in spans], [u for _, u in spans], src])
        rows = to_device(host, device)  # one copy for the five rows
        fed = rows[0] if feed is None else fed_ids(rows[0], rows[4], feed.picks)
        return cls(fed, rows[1], rows[2], rows[3], tuple(spans))

    @property
    def slots(self) -> torch.Tensor:
        """Pool slot each fed token's K/V is written to: the last live slot of its slab."""
        return self.starts + self.used - 1

    @property
    def max_used(self) -> int:
        return max(u for _, u in self.spans)


ExtendLists = tuple[list[int], list[int], list[int], list[int], list[tuple[int, int, int]]]


def extend_lists(requests: Sequence[tuple[Sequence[int], int, int, int]]) -> ExtendLists:
    """Host lists of an extend from (new ids, first position, slab start, live slots before) per request: every
    token's id, position and pool slot, the query offsets (cu_q) and each row's (start, used after, new) span."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu, spans = [0], []
    for new, position, start, live in requests:
        n = len(new)
        ids += new
        positions += range(position, position + n)
        slots += range(start + live, start + live + n)
        cu.append(cu[-1] + n)
        spans.append((start, live + n, n))
    return ids, positions, slots, cu, spans


@dataclass(frozen=True)
class ExtendRows:
    """Inputs of one batched extend: several new tokens per request (questions admitted together), each request's
    tokens after the live slots of its own slab. Row r's queries are ids[cu[r]:cu[r+1]]."""

    ids: torch.Tensor  # [T] every request's new tokens, request after request
    positions: torch.Tensor  # [T] their rotary positions
    slots: torch.Tensor  # [T] the pool slot each token's K/V is written to
    cu_q: torch.Tensor  # [R+1] where each request's tokens start in `ids` (int32, or int64 from `from_flat`)
    starts: torch.Tensor  # [R] each slab's first slot
    used: torch.Tensor  # [R] live slots of each slab after the extend (the new tokens included)
    last: torch.Tensor  # [R] index in `ids` of each request's last token (its logits are returned)
    spans: tuple[tuple[int, int, int], ...]  # (start, used, new tokens) per request, on the host

    @classmethod
    def build(cls, requests: Sequence[tuple[Sequence[int], int, int, int]], device: torch.device) -> ExtendRows:
        """From (new ids, first position, slab start, live slots before) per request."""
        if not requests or any(not ids for ids, *_ in requests):
            raise ValueError("an extend needs at least one request, each with at least one new token")
        ids, positions, slots, cu, spans = extend_lists(requests)
        per_token = torch.tensor([ids, positions, slots]).to(device, non_blocking=True)
        per_row = torch.tensor([[s for s, _, _ in spans], [u for _, u, _ in spans], [c - 1 for c in cu[1:]]])
        rows = per_row.to(device, non_blocking=True)
        cu_q = torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
        return cls(per_token[0], per_token[1], per_token[2], cu_q, rows[0], rows[1], rows[2], tuple(spans))

    @classmethod
    def from_flat(
        cls, flat: torch.Tensor, rows: int, tokens: int, spans: tuple[tuple[int, int, int], ...] = ()
    ) -> ExtendRows:
        """Views over one flat tensor laid out by `extend_layout` (a CUDA graph's static inputs): `tokens`
        ids, positions and slots, then `rows` starts, used and last indices, then `rows + 1` cu_q entries."""
        ids, positions, slots = flat[: 3 * tokens].view(3, tokens)
        per_row = flat[3 * tokens : 3 * tokens + 3 * rows].view(3, rows)
        # A view, like the rest (int64): converted where the attention is built, so a graph captures the conversion.
        cu_q = flat[3 * tokens + 3 * rows : 3 * tokens + 4 * rows + 1]
        return cls(ids, positions, slots, cu_q, per_row[0], per_row[1], per_row[2], spans)

    @property
    def max_new(self) -> int:
        return max(n for _, _, n in self.spans)

    @property
    def max_used(self) -> int:
        return max(u for _, u, _ in self.spans)


class BatchDecoder:
    """Runs batched decode steps over a pool with the forward's weights and modules."""

    def __init__(self, forward: LeanForward, pool: KVPool, attention: str = "auto") -> None:
        if pool.spec != forward.spec:
            raise ValueError("the pool was sized for another model")
        self.forward = forward
        self.pool = pool
        self.attention = resolve_batch_attention(forward.spec, attention)
        self._extend_backend: str | None = None

    @torch.inference_mode()
    def step(self, rows: DecodeRows, width: int | None = None) -> torch.Tensor:
        """Feed each row's token, write its K/V into its slab; returns fp32 logits [B, vocab]. `width`: see
        `batch_attention` (a CUDA graph capturing this step passes its capacity)."""
        fwd = self.forward
        hidden = fwd.embed_static(rows.ids.view(1, -1))
        attend = batch_attention(self.attention, rows, self.pool.slots, width)
        hidden = fwd.layers_static(self.pool.data, hidden, rows.positions, rows.slots, attend, (0, len(fwd.layers)))
        return fwd.head_rows(hidden)

    @torch.inference_mode()
    def extend(self, rows: ExtendRows, bounds: tuple[int, int] | None = None) -> torch.Tensor:
        """Feed each request its new tokens (causal among themselves, after its live slots), writing their K/V into
        its slab; returns fp32 logits [R, vocab] of each request's last token. The decode step is the case of one
        new token per request: the same per-layer code, only the attention's query rows differ. `bounds`: the
        most new tokens and live slots of any row (flash's max_seqlen_q/k); None: read from the host spans (a
        captured extend has none and passes its buckets)."""
        fwd = self.forward
        hidden = fwd.embed_static(rows.ids.view(1, -1))
        attend = extend_attention(self.extend_backend, rows, self.pool.slots, bounds)
        hidden = fwd.layers_static(self.pool.data, hidden, rows.positions, rows.slots, attend, (0, len(fwd.layers)))
        return fwd.head_rows(hidden.index_select(0, rows.last))

    @torch.inference_mode()
    def mixed(
        self,
        decode: DecodeRows,
        extend: ExtendRows,
        width: int | None = None,
        bounds: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """A decode step and an extend in ONE forward (questions piggybacked on the running answers' step,
        Sarathi-Serve): every matmul runs once over the decode rows' tokens then the extend's, so the weights are
        read once for both; the attention runs each part through its own kernel (the decode rows through the decode
        step's, whose one-query form reads each KV head once; an extend kernel would walk every row's context once
        per query head). Returns fp32 logits [B + R, vocab]: the decode rows', then each extend row's last token's.
        `width` and `bounds`: as `step` and `extend` take them."""
        fwd = self.forward
        batch = decode.ids.shape[0]
        step_attend = batch_attention(self.attention, decode, self.pool.slots, width)
        extend_attend = extend_attention(self.extend_backend, extend, self.pool.slots, bounds)

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
            head = step_attend(q[:batch], keys, values, scale)
            return torch.cat((head, extend_attend(q[batch:], keys, values, scale)))

        hidden = fwd.embed_static(torch.cat((decode.ids, extend.ids)).view(1, -1))
        positions = torch.cat((decode.positions, extend.positions))
        slots = torch.cat((decode.slots, extend.slots))
        hidden = fwd.layers_static(self.pool.data, hidden, positions, slots, attend, (0, len(fwd.layers)))
        last = torch.cat((torch.arange(batch, device=hidden.device), extend.last + batch))
        return fwd.head_rows(hidden.index_select(0, last))

    @property
    def extend_backend(self) -> str:
        """The extend's attention: flash varlen where the decode step uses it and the extend probe agrees with
        the loop (checked once), else the loop (eager per request; correct everywhere)."""
        if self._extend_backend is None:
            self._extend_backend = LOOP
            if self.attention == FLASH_VARLEN:
                spec = self.forward.spec
                self._extend_backend = flash_if_it_agrees(
                    lambda: probe_extend(spec, FLASH_VARLEN), LOOP, "batched question prefill"
                )
        return self._extend_backend


def extend_attention(
    backend: str, rows: ExtendRows, pool_slots: int, bounds: tuple[int, int] | None = None
) -> StaticAttend:
    """The attention of each request's new tokens over its slab's live slots, causal and end-aligned (a token
    sees the context and the new tokens up to itself). `bounds`: see `BatchDecoder.extend`; given (a captured
    extend), flash splits each context into key ranges while the new tokens are few (`extend_splits`). Eagerly
    the split's ~20 small kernels a layer cost more in launches than they save (they doubled one question's
    extend), so an eager extend runs one flash call."""
    if backend == LOOP:
        return _extend_loop(rows.spans)
    if backend == FLASH_VARLEN:
        splits = extend_splits(rows.ids.shape[0]) if bounds is not None else 1
        return _extend_flash(rows, pool_slots, bounds or (rows.max_new, rows.max_used), splits)
    raise ValueError(f"extend attention must be {LOOP} or {FLASH_VARLEN}")


def _extend_loop(spans: Sequence[tuple[int, int, int]]) -> StaticAttend:
    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        outs, first = [], 0
        for start, used, new in spans:
            if new == 0:  # an empty row of a padded layout: no queries, nothing to attend
                continue
            k = keys[:, start : start + used].unsqueeze(0)
            v = values[:, start : start + used].unsqueeze(0)
            rows_q = q[first : first + new].transpose(0, 1).unsqueeze(0)  # [1, H, new, D]
            outs.append(attend_causal_end(rows_q, k, v, scale)[0])  # [new, H, D]
            first += new
        return torch.cat(outs)

    return attend


def _extend_flash(rows: ExtendRows, pool_slots: int, bounds: tuple[int, int], splits: int) -> StaticAttend:
    # With `splits` > 1 each row's context is split into key ranges (`extend_split`). Otherwise as the decode
    # step's call, with several queries per request: flash aligns the causal mask to the bottom right of each
    # (queries, used keys) pair, which is exactly "the context, then the new tokens causally".
    # Upper bounds are enough for max_q/max_k: the kernel reads each row's own lengths from cu_q and seqused_k.
    if splits > 1:
        return extend_split(rows.cu_q, rows.starts, rows.used, bounds, pool_slots, splits)
    max_q, max_k = bounds
    cu_q = rows.cu_q.to(torch.int32)
    return flash_varlen(cu_q, _slab_offsets(rows.starts, pool_slots), rows.used.to(torch.int32), max_q, max_k)


def _slab_offsets(starts: torch.Tensor, pool_slots: int) -> torch.Tensor:
    """flash's cu_seqlens_k over the pool: row b's keys start at its slab's first slot. With seqused_k giving each
    row's length, the offsets need not be increasing."""
    return torch.cat((starts, starts.new_full((1,), pool_slots))).to(torch.int32)


def batch_attention(backend: str, rows: DecodeRows, pool_slots: int, width: int | None = None) -> StaticAttend:
    """The attention of one query per row over that row's live slots of the pool, built once per step.

    `width` bounds every row's live length (flash's max_seqlen_k, the gather's width); None: this step's
    longest. A captured step passes its capacity bucket, having no host lengths to read.
    """
    if backend == LOOP:
        return _loop(rows.spans)
    width = rows.max_used if width is None else width
    if backend == FLASH_VARLEN:
        return _flash_varlen(rows, pool_slots, width)
    if backend == SDPA_GATHER:
        return _sdpa_gather(rows, width, pool_slots)
    raise ValueError(f"batch attention must be one of {', '.join(BATCH_ATTENTION)}")


def _loop(spans: Sequence[tuple[int, int]]) -> StaticAttend:
    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        outs = []
        for row, (start, used) in enumerate(spans):
            k = keys[:, start : start + used].unsqueeze(0)
            v = values[:, start : start + used].unsqueeze(0)
            outs.append(attend_causal_end(q[row].unsqueeze(0).unsqueeze(2), k, v, scale)[0, 0])
        return torch.stack(outs)

    return attend


def _flash_varlen(rows: DecodeRows, pool_slots: int, max_k: int) -> StaticAttend:
    batch = rows.ids.shape[0]  # not the host spans: a captured step has none
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=rows.ids.device)
    return flash_varlen(cu_q, _slab_offsets(rows.starts, pool_slots), rows.used.to(torch.int32), 1, max_k)


def _sdpa_gather(rows: DecodeRows, width: int, pool_slots: int) -> StaticAttend:
    """Gather each row's first `width` slab slots (index and mask made once per step, not per layer)."""
    offsets = torch.arange(width, device=rows.ids.device)
    index = (rows.starts.unsqueeze(1) + offsets).clamp_(max=pool_slots - 1)  # [B, M]; past-the-end rows masked
    live = offsets < rows.used.unsqueeze(1)  # [B, M]
    live4 = live.view(live.shape[0], 1, width, 1)

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, dim = q.shape
        kv_heads = keys.shape[0]
        # Dead slots are zeroed, not only masked: a masked NaN still turns the weighted sum NaN (0 * NaN).
        k = torch.where(live4, keys[:, index].transpose(0, 1), 0)
        v = torch.where(live4, values[:, index].transpose(0, 1), 0)
        mask = torch.zeros(live.shape, dtype=q.dtype, device=q.device).masked_fill(~live, float("-inf"))
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # a KV group's query heads as its rows
        out = F.scaled_dot_product_attention(grouped, k, v, mask.view(batch, 1, 1, width), scale=scale)
        return out.reshape(batch, heads, dim)

    return attend


# ---- picking the backend --------------------------------------------------------------------------------


def resolve_batch_attention(spec: ModelSpec, requested: str = "auto") -> str:
    """`requested`, or for "auto": loop on the CPU; on CUDA flash varlen where it runs and agrees with the loop
    on a NaN-poisoned probe, else sdpa_gather."""
    if requested in BATCH_ATTENTION:
        return requested
    if requested != "auto":
        raise ValueError(f"batch attention must be auto or one of {', '.join(BATCH_ATTENTION)}")
    if spec.device.type != "cuda":
        return LOOP
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return SDPA_GATHER
    return flash_if_it_agrees(lambda: probe_attention(spec, FLASH_VARLEN), SDPA_GATHER, "batched attention")


@torch.inference_mode()
def probe_attention(spec: ModelSpec, backend: str, pool_slots: int = 256) -> float:
    """Largest |backend - loop| for three rows of different lengths in a pool whose other slots hold NaN
    (any read outside a row's live slots makes the difference NaN, which fails every comparison)."""
    generator = torch.Generator(device=spec.device).manual_seed(0)
    kv_heads, d = spec.num_kv_heads, spec.head_dim
    kv = torch.full((2, kv_heads, pool_slots, d), float("nan"), dtype=spec.dtype, device=spec.device)
    spans = ((3, 40), (100, 1), (150, 97))
    for start, used in spans:
        live = torch.randn((2, kv_heads, used, d), generator=generator, device=spec.device)
        kv[:, :, start : start + used] = live.to(spec.dtype)
    wide = torch.randn((3, spec.num_heads + kv_heads, d), generator=generator, device=spec.device).to(spec.dtype)
    q = wide[:, : spec.num_heads]  # strided like the q slice of `layers_static`
    rows = DecodeRows.build([0, 0, 0], [0, 0, 0], spans, spec.device)
    got = batch_attention(backend, rows, pool_slots)(q, kv[0], kv[1], d**-0.5)
    want = batch_attention(LOOP, rows, pool_slots)(q, kv[0], kv[1], d**-0.5)
    return float((got.float() - want.float()).abs().max())


@torch.inference_mode()
def probe_extend(spec: ModelSpec, backend: str, pool_slots: int = 256) -> float:
    """Largest |backend - loop| of an extend over three requests of different context and new lengths, in a pool
    whose other slots hold NaN, eagerly and as a captured extend runs it (its context split into key ranges)."""
    generator = torch.Generator(device=spec.device).manual_seed(1)
    kv_heads, d = spec.num_kv_heads, spec.head_dim
    kv = torch.full((2, kv_heads, pool_slots, d), float("nan"), dtype=spec.dtype, device=spec.device)
    requests = ((3, 40, 5), (100, 0, 7), (150, 90, 1))  # (slab start, live before, new tokens)
    for start, live, new in requests:
        filled = torch.randn((2, kv_heads, live + new, d), generator=generator, device=spec.device)
        kv[:, :, start : start + live + new] = filled.to(spec.dtype)
    rows = ExtendRows.build([([0] * new, 0, start, live) for start, live, new in requests], spec.device)
    total = sum(new for _, _, new in requests)
    wide = torch.randn((total, spec.num_heads + kv_heads, d), generator=generator, device=spec.device).to(spec.dtype)
    q = wide[:, : spec.num_heads]
    want = extend_attention(LOOP, rows, pool_slots)(q, kv[0], kv[1], d**-0.5)
    worst = 0.0
    for bounds in (None, (rows.max_new, rows.max_used)):  # eager (one call), and captured (split key ranges)
        got = extend_attention(backend, rows, pool_slots, bounds)(q, kv[0], kv[1], d**-0.5)
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    return worst
