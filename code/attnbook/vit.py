# Do not edit: tools/tangle.py generates this file from chapters/18-vision-transformer.md.
"""The Vision Transformer: images cut into patches, a class token and learned positions, on the
book's Transformer blocks.

Built and explained in the book's chapter chapters/18-vision-transformer.md.
"""

__all__ = [
    "patchify",
    "ViTConfig",
    "ViT",
]

# chapters/18-vision-transformer.md, "An image as a sequence of patches"
from dataclasses import dataclass

import torch
from torch import nn

from attnbook.checks import (
    check_bool,
    check_divisible,
    check_instance,
    check_int,
    check_positive,
    check_probability,
    check_tensor,
)
from attnbook.layers import Block, BlockConfig


def _patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """patchify's computation, on images already checked (by patchify, or by ViT.forward)."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // p, p, w // p, p)  # (B, C, rows, p, cols, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, rows, cols, C, p, p)
    return x.reshape(b, (h // p) * (w // p), c * p * p)  # (B, N, C p p)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) floating-point images (convert uint8 ones with .float()) -> (B, (H/p)(W/p),
    C p p) patches, in row-major order, each flattened in (channel, row, column) order:
    F.unfold(images, p, stride=p).transpose(1, 2). Chapter 18."""
    images = check_tensor("images", images, 4)
    p = check_int("patch_size", patch_size, minimum=1)
    check_divisible("images.shape[2]", images.shape[2], "patch_size", p)  # the height
    check_divisible("images.shape[3]", images.shape[3], "patch_size", p)  # the width
    return _patchify(images, p)


# chapters/18-vision-transformer.md, "The model"
@dataclass(frozen=True)
class ViTConfig:
    """The sizes of a Vision Transformer, by default ViT-B/16's (chapter 18): square images of
    image_size pixels, cut into patches of patch_size, for num_classes classes."""

    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    dropout: float = 0.0
    eps: float = 1e-6
    backend: str = "sdpa"  # the attention's fast path, as in chapter 10's GPTConfig

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "num_classes", "d_model",
                     "num_layers", "num_heads", "d_ff"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        object.__setattr__(self, "dropout", check_probability("dropout", self.dropout))
        object.__setattr__(self, "eps", check_positive("eps", self.eps))
        check_divisible("image_size", self.image_size, "patch_size", self.patch_size)
        self.block  # noqa: B018 (BlockConfig checks the rest: the heads and the backend)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:  # the numbers in one patch
        return self.in_channels * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def block(self) -> BlockConfig:
        """Every block's settings: pre-norm, with exact GELU (PyTorch's default; the paper's
        released code uses the tanh approximation)."""
        return BlockConfig(self.d_model, self.num_heads, self.d_ff, self.dropout, norm_first=True,
                           activation="gelu", eps=self.eps, backend=self.backend)


# chapters/18-vision-transformer.md, "The model"
class ViT(nn.Module):
    """The Vision Transformer (chapter 18): images (B, C, H, W) -> logits (B, num_classes)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = check_instance("config", config, ViTConfig)
        self.patch_embed = nn.Linear(c.patch_dim, c.d_model)  # E
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.position = nn.Parameter(torch.empty(1, c.num_patches + 1, c.d_model))  # E_pos
        nn.init.normal_(self.position, std=0.02)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.block) for _ in range(c.num_layers))  # unchecked
        self.norm = nn.LayerNorm(c.d_model, eps=c.eps)
        self.head = nn.Linear(c.d_model, c.num_classes)

    def forward(self, images: torch.Tensor, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, num_classes), and with `return_weights` the list of each block's attention
        weights (B, num_heads, 1 + N, 1 + N), the class token first."""
        c, weight = self.config, self.patch_embed.weight
        images = check_tensor("images", images, 4, dtype=weight.dtype, device=weight.device,
                              shape=(None, c.in_channels, c.image_size, c.image_size))
        return_weights = check_bool("return_weights", return_weights)  # the checks: no more
        x = self.patch_embed(_patchify(images, c.patch_size))  # (B, N, d_model)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, d_model)
        x = self.dropout(torch.cat([cls, x], dim=1) + self.position)  # (B, 1 + N, d_model)
        weights = []  # only with return_weights: else the blocks take the fast path
        for block in self.blocks:
            x = block(x, return_weights=return_weights)
            if return_weights:
                x, block_weights, _ = x
                weights.append(block_weights)  # (B, nh, 1 + N, 1 + N)
        logits = self.head(self.norm(x[:, 0]))  # the class token's output: (B, num_classes)
        return (logits, weights) if return_weights else logits
