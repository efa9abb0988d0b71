# Do not edit: tools/tangle.py generates this file from chapters/10-gpt.md.
"""The book's one training recipe: AdamW with decay on matrices only, warm-up and cosine decay,
clipping, one step, and the batches and held-out loss of a run.

Built and explained in the book's chapter chapters/10-gpt.md.
"""

__all__ = [
    "Recipe",
    "make_optimizer",
    "learning_rate",
    "train_step",
    "batch",
    "held_out_split",
    "held_out_loss",
]

# chapters/10-gpt.md, "The training recipe"
import math  # noqa: F811 (notebook)
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: F811 (notebook)
from torch import nn

from attnbook.checks import check_instance, check_int, check_probability, check_real  # noqa: F811


@dataclass(frozen=True)
class Recipe:
    """Chapter 10's training recipe: AdamW's settings, the learning rate's schedule, clipping."""

    lr: float = 6e-3  # the peak learning rate
    warmup: int = 30  # steps over which the rate rises linearly to lr
    min_lr_ratio: float = 0.1  # the rate at the end of the cosine, as a share of lr
    weight_decay: float = 0.1  # on weight matrices only
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0  # the gradient's largest norm; math.inf for no clipping

    def __post_init__(self) -> None:
        check_real("lr", self.lr, 0.0, open_low=True)
        check_int("warmup", self.warmup, minimum=0)
        check_probability("min_lr_ratio", self.min_lr_ratio)
        check_real("weight_decay", self.weight_decay, 0.0)
        if len(check_instance("betas", self.betas, tuple)) != 2:
            raise ValueError(f"betas must be a pair, got betas={self.betas!r}")
        for i, beta in enumerate(self.betas):
            check_real(f"betas[{i}]", beta, 0.0, 1.0, open_high=True)
        _check_clip(self.clip)


def _check_clip(clip: object) -> float:
    """A gradient's largest norm: a number above 0, or math.inf for no clipping."""
    return math.inf if clip == math.inf else check_real("clip", clip, 0.0, open_low=True)


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, decaying the matrices (ndim >= 2) only."""
    params, recipe = [p for p in model.parameters() if p.requires_grad], check_instance(
        "recipe", recipe, Recipe)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas)


def learning_rate(recipe: Recipe, step: int, steps: int) -> float:
    """The learning rate of `step` (1 to `steps`): up in a line over recipe.warmup steps, then
    down along half a cosine towards recipe.min_lr_ratio * recipe.lr at the end of the run."""
    recipe, steps = check_instance("recipe", recipe, Recipe), check_int("steps", steps, minimum=1)
    step = check_int("step", step, minimum=1, maximum=steps)
    if step <= recipe.warmup:
        return recipe.lr * step / recipe.warmup
    done = (step - 1 - recipe.warmup) / (steps - recipe.warmup)  # 0 just after the warm-up
    low = recipe.min_lr_ratio
    return recipe.lr * (low + (1 - low) * (1 + math.cos(math.pi * done)) / 2)


# chapters/10-gpt.md, "The training recipe"
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, lr: float,
               clip: float = math.inf) -> tuple[torch.Tensor, torch.Tensor]:
    """One update on next-token targets y for inputs x, (B, T) each, at learning rate `lr`, the
    gradient clipped to norm `clip`: the batch's mean loss and the gradient's norm before
    clipping, 0-d tensors, detached and not read."""
    lr, clip = check_real("lr", lr, 0.0, open_low=True), _check_clip(clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B * T, V) against (B * T,)
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(loss)  # loss.backward(), typed
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # inf: scales by 1
    optimizer.step()
    return loss.detach(), norm.detach()


def batch(ids: torch.Tensor, step: int, size: int, context: int,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step` (< 2**20) of a run seeded `seed` (< 4096): `size` windows of `ids`, inputs
    and targets (size, context) each, targets one token on; set by `seed` and `step` alone."""
    ids, seed = _check_ids(ids), check_int("seed", seed, 0, 2**12 - 1)
    context = check_int("context", context, minimum=1, maximum=len(ids) - 1)
    size, step = check_int("size", size, minimum=1), check_int("step", step, 0, 2**20 - 1)
    generator = torch.Generator().manual_seed(seed * 2**20 + step)  # 32 bits kept: 12 + 20
    starts = torch.randint(len(ids) - context, (size,), generator=generator)  # (size,)
    windows = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])  # (size, context + 1)
    return windows[:, :-1], windows[:, 1:]


def held_out_split(ids: torch.Tensor, block: int = 4096,
                   every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, held-out ids): every `every`-th block of `block` ids is held out."""
    blocks = torch.split(_check_ids(ids), check_int("block", block, minimum=1))
    if len(blocks) < check_int("every", every, minimum=2):
        raise ValueError(f"ids must hold at least {every} blocks of {block}, got {len(ids)} ids")
    held = [b for i, b in enumerate(blocks) if i % every == every - 1]
    return torch.cat([b for i, b in enumerate(blocks) if i % every != every - 1]), torch.cat(held)


def _check_ids(ids: object) -> torch.Tensor:
    if isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point():
        return ids
    raise TypeError(f"ids must be a 1-D tensor of token ids, got {type(ids).__name__} {ids!r:.40}")


@torch.no_grad()
def held_out_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean next-token loss on (x, y) in eval mode; the model is left in the mode it had."""
    was_training = model.training
    try:
        return F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten()).item()
    finally:
        model.train(was_training)
