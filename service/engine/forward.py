"""A lean forward over the HF model's own modules, with explicit positions and caller-owned KV.

HF's generic cache path cannot express "these cached keys sit at these positions" nor "each chunk attends
only to itself"; this forward can, while reusing the model's norms, projections, MLPs and rotary embedding so
the arithmetic is the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from service.engine.attention import attend_causal_end
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES, KVBlock
from service.engine.model import LoadedModel
from service.engine.rotary import Rotary


class LeanForward:
    """Precompute independent blocks and extend a `KVBuffer` token by token or question at once."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.spec = model.spec
        self.decoder = model.decoder
        self.layers: list[Any] = list(self.decoder.layers)
        self.rotary = Rotary(self.decoder.rotary_emb, self.spec.head_dim, self.spec.device)

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
    def precompute(self, blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        """KV of several blocks in one pass; each block attends only to itself at local positions 0..len-1."""
        if not blocks or any(len(b) == 0 for b in blocks):
            raise ValueError("precompute needs one or more non-empty blocks")
        lengths = [len(b) for b in blocks]
        longest = max(lengths)
        if longest > self.spec.max_context:
            raise ValueError(f"block of {longest} tokens exceeds the model's context of {self.spec.max_context}")
        # Right padding keeps every real token's causal view free of padding, so one causal kernel is exact.
        ids = torch.zeros((len(blocks), longest), dtype=torch.long, device=self.spec.device)
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = torch.tensor(list(block), dtype=torch.long)
        outputs = [self._empty_block(n) for n in lengths]
        cos, sin = self.rotary.cos_sin(torch.arange(longest))
        hidden = self.decoder.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._project(layer, layer.input_layernorm(hidden))
            for row, n in enumerate(lengths):
                outputs[row][index, KEYS].copy_(k[row, :, :n])
                outputs[row][index, VALUES].copy_(v[row, :, :n])
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
            out = attend_causal_end(q, k, v, layer.self_attn.scaling)
            hidden = self._finish_layer(layer, residual, out)
        return [KVBlock(tuple(int(t) for t in b), kv) for b, kv in zip(blocks, outputs, strict=True)]

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
