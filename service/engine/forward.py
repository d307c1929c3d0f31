"""A lean forward over the HF model's own modules, with explicit positions and caller-owned KV.

HF's generic cache path cannot express "these cached keys sit at these positions" nor "each chunk attends
only to itself"; this forward can, while reusing the model's norms, projections, MLPs and rotary embedding so
the arithmetic is the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from service.engine import act_mul, kv_write
from service.engine.attention import StaticAttend, attend_causal_end
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES, KVBlock
from service.engine.model import LoadedModel
from service.engine.rotary import Rotary


@runtime_checkable
class LayerAttend(Protocol):
    """An attention `layers_static` calls with the layer index and the UNROTATED queries, instead of a
    `StaticAttend` (rotated queries, the pool layer's keys and values).

    Segment attention (`shared_decode.py`) needs both: its chunks live in an arena outside the pool, one tensor per
    layer, with keys at local positions, so it rotates each query per chunk itself. `layers_static` checks for this
    protocol once per call, so every existing attend runs unchanged and pays nothing per layer.
    """

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention [T, Hq, D] of the unrotated q [T, Hq, D] (unit stride on D) of layer `layer`; `kv` is the
        pool's layer [2, Hkv, slots, D], the new tokens' keys (rotated) and values already written."""
        ...


class LeanForward:
    """Precompute independent blocks and extend a `KVBuffer` token by token or question at once."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.spec = model.spec
        self.decoder = model.decoder
        self.layers: list[Any] = list(self.decoder.layers)
        self.rotary = Rotary(self.decoder.rotary_emb, self.spec.head_dim, self.spec.device)
        self._fused: list[_DecodeWeights] = []

    # ---- shared per-layer pieces -------------------------------------------------------------------------

    def _project(self, layer: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape [B, heads, T, D] from normed hidden states [B, T, hidden]."""
        attn = layer.self_attn
        batch, tokens, _ = hidden.shape
        d = self.spec.head_dim
        q = attn.q_proj(hidden).view(batch, tokens, -1, d).transpose(1, 2)
        k = attn.k_proj(hidden).view(batch, tokens, -1, d).transpose(1, 2)
        v = attn.v_proj(hidden).view(batch, tokens, -1, d).transpose(1, 2)
        return q, k, v

    def _finish_layer(self, layer: Any, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, post-attention norm, MLP, residual; attn_out is [B, T, heads, D]."""
        batch, tokens = attn_out.shape[:2]
        hidden: torch.Tensor = residual + layer.self_attn.o_proj(attn_out.reshape(batch, tokens, -1))
        mlp_out: torch.Tensor = layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + mlp_out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.hf.lm_head(self.decoder.norm(hidden))
        return logits.float()

    # ---- precompute --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def precompute(self, blocks: Sequence[Sequence[int]], prefix: KVBlock | None = None) -> list[KVBlock]:
        """KV of several blocks in one pass. Without `prefix` each block attends only to itself at local positions
        0..len-1; with it, each attends to the prefix's KV (at 0..P-1) and then to itself at P..P+len-1."""
        if not blocks or any(len(b) == 0 for b in blocks):
            raise ValueError("precompute needs one or more non-empty blocks")
        lengths = [len(b) for b in blocks]
        longest = max(lengths)
        start = 0 if prefix is None else prefix.num_tokens
        if start + longest > self.spec.max_context:
            raise ValueError(f"block of {longest} tokens exceeds the model's context of {self.spec.max_context}")
        # Right padding keeps every real token's causal view free of padding, so one causal kernel is exact.
        ids = torch.zeros((len(blocks), longest), dtype=torch.long, device=self.spec.device)
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = torch.tensor(list(block), dtype=torch.long)
        outputs = [self._empty_block(n) for n in lengths]
        cos, sin = self.rotary.cos_sin(torch.arange(start, start + longest))
        hidden = self.decoder.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._project(layer, layer.input_layernorm(hidden))
            for row, n in enumerate(lengths):
                outputs[row][index, KEYS].copy_(k[row, :, :n])
                outputs[row][index, VALUES].copy_(v[row, :, :n])
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
            if prefix is not None:
                k, v = self._after_prefix(prefix, index, k, v)
            out = attend_causal_end(q, k, v, layer.self_attn.scaling)
            hidden = self._finish_layer(layer, residual, out)
        return [KVBlock(tuple(int(t) for t in b), kv) for b, kv in zip(blocks, outputs, strict=True)]

    def _after_prefix(
        self, prefix: KVBlock, index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s prefix keys (rotated to 0..P-1) and values before every row's own: the causal kernel,
        aligned at the end, then lets each block token see the whole prefix and its own block up to itself."""
        rows, length = keys.shape[0], prefix.num_tokens
        kv = prefix.kv[index].to(keys.device)
        prefix_keys = self.rotary.rotate(kv[KEYS].unsqueeze(0), torch.arange(length, device=keys.device))
        prefix_keys = prefix_keys.to(keys.dtype).expand(rows, -1, -1, -1)
        prefix_values = kv[VALUES].unsqueeze(0).to(values.dtype).expand(rows, -1, -1, -1)
        return torch.cat([prefix_keys, keys], dim=2), torch.cat([prefix_values, values], dim=2)

    def _empty_block(self, num_tokens: int) -> torch.Tensor:
        s = self.spec
        shape = (s.num_layers, 2, s.num_kv_heads, num_tokens, s.head_dim)
        return torch.empty(shape, dtype=s.dtype, device=s.device)

    # ---- extend a sequence ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(
        self, buffer: KVBuffer, token_ids: Sequence[int], positions: torch.Tensor, all_logits: bool = False
    ) -> torch.Tensor:
        """Append tokens at the given positions, attending to everything already in the buffer.

        Returns fp32 logits [T, vocab] when `all_logits`, else [vocab] of the last token.
        """
        count = len(token_ids)
        start = buffer.reserve(count)
        end = start + count
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.spec.device)
        cos, sin = self.rotary.cos_sin(positions)
        hidden = self.decoder.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._project(layer, layer.input_layernorm(hidden))
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
            buffer.write(index, start, k[0], v[0])
            keys = buffer.keys(index, end).unsqueeze(0)
            values = buffer.values(index, end).unsqueeze(0)
            out = attend_causal_end(q, keys, values, layer.self_attn.scaling)
            hidden = self._finish_layer(layer, residual, out)
        buffer.commit(count, int(positions[-1]) + 1)
        logits = self._logits(hidden if all_logits else hidden[:, -1:])
        return logits[0] if all_logits else logits[0, -1]

    # ---- fixed-shape steps (CUDA graphs) ------------------------------------------------------------------

    @torch.inference_mode()
    def decode_static(
        self,
        data: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slot: torch.Tensor,
        attend: StaticAttend,
    ) -> torch.Tensor:
        """One decode token (`ids` [1, 1], `positions` and `slot` [1]) through `forward_static`; fp32 logits."""
        return self.forward_static(data, ids, positions, slot, attend)

    @torch.inference_mode()
    def forward_static(
        self,
        data: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: StaticAttend,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """T tokens through every layer with all inputs in device tensors; returns fp32 logits [vocab] of the
        token at index `last` [1] (default: the last one).

        `data` is a KV buffer's storage `[layers, 2, kv_heads, capacity, head_dim]`, `ids` [1, T] the tokens,
        `positions` [T] their rotary positions and `slots` [T] where their keys and values are written. Nothing
        here reads a tensor on the host, branches on a value or sizes anything by the length, so a CUDA graph can
        capture it once and replay it at any length (a decode step is T = 1, a question prefill T = its bucket).
        Same modules and weights as `extend`, with fewer kernels, since inside a graph each small kernel still
        costs ~2 us and 50 per layer were half a decode step: q/k/v and gate/up run as one matmul each, RMSNorm
        as one fused kernel, q and k are rotated together, and o_proj and down_proj add the residual in their
        epilogue. The results agree with `extend` to bf16 rounding.
        """
        hidden = self.embed_static(ids)
        hidden = self.layers_static(data, hidden, positions, slots, attend, (0, len(self.layers)))
        return self.head_static(hidden, last)

    def embed_static(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states [T, hidden] of `ids` [1, T]: the first piece of `forward_static`."""
        embedded: torch.Tensor = self.decoder.embed_tokens(ids)[0]
        return embedded

    def layers_static(
        self,
        data: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: StaticAttend | LayerAttend,
        layers: tuple[int, int],
    ) -> torch.Tensor:
        """`hidden` [T, hidden] through layers [first, end) of `forward_static` (the same kernels in the same
        order, so a prefill run as several layer-range segments computes the very same numbers). A `LayerAttend`
        gets the unrotated queries: only the keys are rotated then (the same elementwise arithmetic)."""
        s = self.spec
        nq, nkv, d, half = s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim // 2
        tokens = hidden.shape[0]
        layer_attend, static_attend = (attend, None) if isinstance(attend, LayerAttend) else (None, attend)
        first = nq if layer_attend is not None else 0  # the first head rotated: q's, or only k's
        cos, sin = self.rotary.cos_sin(positions)
        one_kernel = kv_write.applies(hidden.device)  # else torch's kernels, below
        # rotate_half(x) * sin == roll(x, D/2) * sin with its first half negated: one roll, no neg + cat per layer.
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
        cos_rows = cos.unsqueeze(1)
        for index in range(*layers):
            layer = self.layers[index]
            fused = self._decode_weights(index)
            qkv = F.linear(_rms_norm(layer.input_layernorm, hidden), fused.qkv_weight, fused.qkv_bias)
            qkv = qkv.view(tokens, nq + 2 * nkv, d)
            keys, values = data[index, KEYS], data[index, VALUES]
            if one_kernel:
                q = kv_write.rotate_and_write(qkv, cos, sin, slots, keys, values, first, nq)
            else:
                qk = qkv[:, first : nq + nkv].float()
                qk = torch.addcmul(qk * cos_rows, qk.roll(half, dims=-1), signed_sin).to(hidden.dtype)
                keys.index_copy_(1, slots, qk[:, nq - first :].transpose(0, 1))
                values.index_copy_(1, slots, qkv[:, nq + nkv :].transpose(0, 1))
                q = qk[:, :nq] if first == 0 else None
            if layer_attend is not None:
                out = layer_attend.attend_layer(index, qkv[:, :nq], data[index], layer.self_attn.scaling)
            else:
                assert static_attend is not None and q is not None
                out = static_attend(q, keys, values, layer.self_attn.scaling)
            hidden = _linear_plus(layer.self_attn.o_proj, out.reshape(tokens, -1), hidden)
            normed = _rms_norm(layer.post_attention_layernorm, hidden)
            gate_up = F.linear(normed, fused.gate_up_weight, fused.gate_up_bias)
            if act_mul.applies(layer.mlp.act_fn, hidden.device):
                activated = act_mul.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                activated = layer.mlp.act_fn(gate) * up
            hidden = _linear_plus(layer.mlp.down_proj, activated, hidden)
        return hidden

    def head_static(self, hidden: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [vocab] of the token at index `last` [1] of `hidden` [T, hidden] (default: the last)."""
        if last is not None:
            hidden = hidden.index_select(0, last)  # only the wanted token goes through the norm and the LM head
        return self._logits(hidden.unsqueeze(0))[0, -1]

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of every row of `hidden` [T, hidden] (one per request of a batched step)."""
        return self._logits(hidden.unsqueeze(0))[0]

    def _decode_weights(self, index: int) -> _DecodeWeights:
        """Layer `index`'s q/k/v and gate/up weights fused by rows, made once (outside any graph capture)."""
        while len(self._fused) <= index:
            layer = self.layers[len(self._fused)]
            attn, mlp = layer.self_attn, layer.mlp
            with torch.inference_mode(False), torch.no_grad():
                qkv_weight, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
                gate_up_weight, gate_up_bias = _fuse_rows([mlp.gate_proj, mlp.up_proj])
            self._fused.append(_DecodeWeights(qkv_weight, qkv_bias, gate_up_weight, gate_up_bias))
        return self._fused[index]


@dataclass(frozen=True)
class _DecodeWeights:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None


def _fuse_rows(linears: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights (and biases) of several Linear layers stacked by output rows.

    Each module's weight is then rebound to its rows of the stacked tensor, so the fused copy costs no memory
    (7.6 GB for a 7B model's gate/up otherwise) and the eager and the graph path read the very same numbers.
    """
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears])
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[row : row + rows]
        if bias is not None and m.bias is not None:
            m.bias.data = bias[row : row + rows]
        row += rows
    return weight, bias


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (Llama / Qwen2 / Mistral form: weight * x / rms(x)) as torch's one fused kernel."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _linear_plus(linear: Any, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x) for 2-D x; without a bias the addition rides in the matmul's epilogue."""
    if linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    out: torch.Tensor = residual + linear(x)
    return out
