"""The image side of the imported VLMs: a SigLIP tower (SmolVLM2's and PaliGemma's alike) and the
connector that turns its patches into language-model tokens.

SmolVLM2 numbers its patches as transformers 4.57 did when lerobot made its checkpoints: each axis's
patch coordinates scaled by (1 - 1e-6) and bucketed, so a 4-patch side reads positions [0, 0, 1, 2]
(docs/LEROBOT_IMPORT.md §S2); its connector shuffles 2x2 patches into one token and projects them.
PaliGemma's tower numbers patches 0..N-1 and its projector is one biased Linear.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vlamux.model.vla.layers import Box, SiglipLayer


class VisionTower(nn.Module):
    """`embeddings` (patch Conv2d + position table), `encoder.layers`, `post_layernorm`."""

    def __init__(self, dim: int, layers: int, heads: int, mlp: int, patch: int, positions: int, bucketed: bool,
                 image_size: int):
        super().__init__()
        self.embeddings = Box(patch_embedding=nn.Conv2d(3, dim, patch, stride=patch),
                              position_embedding=nn.Embedding(positions, dim))
        self.encoder = Box(layers=nn.ModuleList(SiglipLayer(dim, heads, mlp) for _ in range(layers)))
        self.post_layernorm = nn.LayerNorm(dim, eps=1e-6)
        self.patch, self.bucketed, self.image_size = patch, bucketed, image_size

    def forward(self, pixels: Tensor) -> Tensor:
        """[B, 3, H, W] in [-1, 1] -> [B, patches, dim]."""
        x = self.embeddings.patch_embedding(pixels)  # [B, dim, h, w]
        h, w = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        ids = self._positions(h, w, x.device) if self.bucketed else torch.arange(h * w, device=x.device)
        x = x + self.embeddings.position_embedding(ids)[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def _positions(self, h: int, w: int, device) -> Tensor:
        """SmolVLM2's bucketed patch positions (transformers 4.57's arithmetic, in fp32)."""
        per_side = self.image_size // self.patch
        bounds = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)

        def axis(n: int) -> Tensor:
            coords = torch.arange(n, dtype=torch.float32, device=device) / n * (1 - 1e-6)
            return torch.bucketize(coords, bounds, right=True)

        return (axis(h)[:, None] * per_side + axis(w)[None, :]).flatten()


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """SmolVLM's connector shuffle: [B, n·n, C] patches -> [B, (n/s)², s²·C] tokens; token (h2, w2) holds
    patch (s·h2 + hr, s·w2 + wr) at features (hr·s + wr)·C + c."""
    b, p, c = x.shape
    n = int(round(p ** 0.5))
    m = n // scale
    x = x.view(b, m, scale, m, scale, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, m * m, scale * scale * c)


class SmolVLMConnector(nn.Module):
    """`modality_projection.proj` (no bias) after the pixel shuffle."""

    def __init__(self, vision_dim: int, text_dim: int, scale: int):
        super().__init__()
        self.modality_projection = Box(proj=nn.Linear(vision_dim * scale * scale, text_dim, bias=False))
        self.scale = scale

    def forward(self, patches: Tensor) -> Tensor:
        return self.modality_projection.proj(pixel_shuffle(patches, self.scale))
