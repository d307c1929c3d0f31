"""RoPE through the model's own rotary embedding, applied in fp32.

Using the model's `rotary_emb` module (not a re-derived formula) keeps llama3 / yarn / linear scaling right,
including yarn's attention factor folded into cos and sin.
"""

from __future__ import annotations

from typing import Any

import torch


class Rotary:
    """cos/sin tables from the model's rotary embedding, and the rotation itself."""

    def __init__(self, rotary_emb: Any, head_dim: int, device: torch.device) -> None:
        self._rotary_emb = rotary_emb
        self._head_dim = head_dim
        self._device = device
        # The rotary module only reads the device and dtype of this probe; fp32 keeps cos/sin unrounded.
        self._probe = torch.empty(0, dtype=torch.float32, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin of shape [T, head_dim] for a 1-D tensor of positions."""
        ids = positions.to(device=self._device, dtype=torch.long).unsqueeze(0)
        cos, sin = self._rotary_emb(self._probe, ids)
        return cos[0].float(), sin[0].float()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """Rotate x [..., T, D] in fp32, times `factor` (a context temperature's 1/T on keys), and cast back to
        x's dtype once."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated_half = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        rotated = xf * cos + rotated_half * sin
        return (rotated if factor == 1.0 else rotated * factor).to(x.dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """Rotate x [..., T, D] to the given positions [T] (times `factor`, see `apply`)."""
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos, sin, factor)
