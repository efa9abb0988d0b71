"""attnbook.recipe (chapter 10, "The training recipe"): the schedule against PyTorch's LambdaLR, one
step against the same step written out with PyTorch's AdamW and clipping, the batches and the
held-out split against their definitions, and the refusals of bad settings."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from attnbook.gpt import GPT, GPTConfig
from attnbook.recipe import (
    Recipe,
    batch,
    held_out_loss,
    held_out_split,
    learning_rate,
    make_optimizer,
    train_step,
)


def tiny_gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=11, context_length=8, d_model=16, num_layers=2, num_heads=2,
                       dropout=dropout)
    return GPT(config).double()


@pytest.mark.parametrize("warmup, steps, low", [(30, 500, 0.1), (0, 7, 0.0), (5, 6, 0.5),
                                                 (3, 3, 0.1), (1, 1, 1.0)])
def test_learning_rate_is_lambdalr_with_the_same_rule(warmup, steps, low):
    recipe = Recipe(lr=2e-3, warmup=warmup, min_lr_ratio=low)

    def factor(s):  # s: the number of steps taken so far, as LambdaLR counts
        if s < warmup:
            return (s + 1) / warmup
        if s >= steps:  # after the last step, asked for by the last scheduler.step()
            return 0.0
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))

    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=recipe.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    for step in range(1, steps + 1):
        assert math.isclose(learning_rate(recipe, step, steps), opt.param_groups[0]["lr"],
                            rel_tol=1e-12)
        opt.step()
        scheduler.step()


def test_learning_rate_rises_then_falls_to_near_its_floor():
    recipe = Recipe()  # 6e-3, 30 steps of warm-up, down to a tenth
    rates = [learning_rate(recipe, s, 500) for s in range(1, 501)]
    assert rates[29] == max(rates) == recipe.lr
    assert all(a < b for a, b in zip(rates[:29], rates[1:30]))
    assert all(a >= b for a, b in zip(rates[29:], rates[30:]))
    assert recipe.lr * 0.1 < rates[-1] < recipe.lr * 0.1001


@pytest.mark.parametrize("step, steps", [(0, 10), (11, 10), (1, 0), (1.0, 10), (True, 10)])
def test_learning_rate_refuses_steps_outside_the_run(step, steps):
    with pytest.raises((ValueError, TypeError), match="step"):
        learning_rate(Recipe(), step, steps)


@pytest.mark.parametrize("clip", [0.05, math.inf])  # the first clips, the second never does
def test_train_step_is_adamw_with_decay_on_matrices_and_clipping(clip):
    ours, theirs = tiny_gpt(), tiny_gpt()
    recipe = Recipe(lr=1e-2, weight_decay=0.3, betas=(0.8, 0.9), clip=clip)
    optimizer = make_optimizer(ours, recipe)
    matrices = [p for n, p in theirs.named_parameters() if p.dim() == 2]
    vectors = [p for n, p in theirs.named_parameters() if p.dim() == 1]
    assert len(matrices) + len(vectors) == len(list(theirs.parameters()))
    reference = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.3},
                                   {"params": vectors, "weight_decay": 0.0}], betas=(0.8, 0.9))
    generator = torch.Generator().manual_seed(1)
    for lr in [1e-2, 3e-3, 5e-3]:
        x, y = torch.randint(11, (3, 8), generator=generator), torch.randint(11, (3, 8),
                                                                             generator=generator)
        loss, norm_before = train_step(ours, optimizer, x, y, lr, clip)
        for group in reference.param_groups:
            group["lr"] = lr
        expected = F.cross_entropy(theirs(x).reshape(-1, 11), y.reshape(-1))
        reference.zero_grad()
        expected.backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), clip)
        assert (norm > clip) == (clip < 1)  # the case clips, or it does not
        reference.step()
        assert not loss.requires_grad and not norm_before.requires_grad
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(norm_before, norm, rtol=1e-12, atol=0)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_make_optimizer_leaves_frozen_parameters_out():
    model = tiny_gpt()
    model.tok_emb.weight.requires_grad_(False)
    groups = make_optimizer(model, Recipe()).param_groups
    held = {id(p) for g in groups for p in g["params"]}
    assert id(model.tok_emb.weight) not in held
    assert len(held) == sum(p.requires_grad for p in model.parameters())
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.dim() >= 2 for p in groups[0]["params"])
    assert all(p.dim() < 2 for p in groups[1]["params"])


def test_a_nan_weight_gives_a_nan_loss_not_a_finite_one():
    model = tiny_gpt()
    with torch.no_grad():
        model.tok_emb.weight[3, 0] = math.nan
    x = torch.full((2, 8), 3)
    loss, norm = train_step(model, make_optimizer(model, Recipe()), x, x, 1e-3, 1.0)
    assert loss.isnan() and norm.isnan()
    assert math.isnan(held_out_loss(model, x, x))


def test_batch_is_windows_at_seeded_places_with_targets_one_token_on():
    ids = torch.arange(1000) * 7
    x, y = batch(ids, step=4, size=5, context=9, seed=2)
    assert x.shape == y.shape == (5, 9) and x.dtype == torch.int64
    starts = torch.randint(1000 - 9, (5,), generator=torch.Generator().manual_seed(2 * 2**20 + 4))
    for row, start in zip(x, starts.tolist()):
        assert torch.equal(row, ids[start:start + 9])
    assert torch.equal(x[:, 1:], y[:, :-1])
    again, _ = batch(ids, 4, 5, 9, seed=2)
    assert torch.equal(again, x) and not torch.equal(batch(ids, 5, 5, 9, seed=2)[0], x)


@pytest.mark.parametrize("length", [40_960, 41_000, 100_001])
def test_held_out_split_holds_out_every_tenth_block(length):
    ids = torch.arange(length)
    train, held = held_out_split(ids)
    assert len(train) + len(held) == length
    assert torch.equal(torch.sort(torch.cat([train, held])).values, ids)  # a partition
    blocks = (ids // 4096) % 10
    assert torch.equal(held, ids[blocks == 9]) and torch.equal(train, ids[blocks != 9])


@pytest.mark.parametrize("args, name", [((torch.arange(100),), "ids"),
                                        ((torch.arange(100), 0), "block"),
                                        ((torch.arange(100), 10, 1), "every")])
def test_held_out_split_refuses_what_cannot_be_split(args, name):
    with pytest.raises(ValueError, match=name):
        held_out_split(*args)


def test_held_out_loss_is_the_eval_mode_loss_and_keeps_the_mode():
    model = tiny_gpt(dropout=0.5).train()
    x, y = torch.randint(11, (4, 8)), torch.randint(11, (4, 8))
    evaluated = copy.deepcopy(model).eval()
    with torch.no_grad():
        expected = F.cross_entropy(evaluated(x).reshape(-1, 11), y.reshape(-1)).item()
    assert held_out_loss(model, x, y) == pytest.approx(expected, rel=1e-12)
    assert model.training
    assert held_out_loss(model.eval(), x, y) == pytest.approx(expected, rel=1e-12)
    assert not model.training


@pytest.mark.parametrize("field, value, error", [
    ("lr", 0.0, ValueError), ("lr", math.nan, ValueError), ("lr", "1e-3", TypeError),
    ("warmup", -1, ValueError), ("warmup", 2.5, TypeError), ("min_lr_ratio", 1.5, ValueError),
    ("weight_decay", -0.1, ValueError), ("betas", (0.9,), ValueError),
    ("betas", [0.9, 0.95], TypeError), ("betas", (0.9, 1.0), ValueError),
    ("clip", 0.0, ValueError), ("clip", -math.inf, ValueError), ("clip", math.nan, ValueError),
])
def test_recipe_refuses_a_bad_setting_by_name(field, value, error):
    with pytest.raises(error, match=field):
        Recipe(**{field: value})


def test_recipe_is_frozen_and_clip_may_be_infinite():
    recipe = Recipe(clip=math.inf)
    with pytest.raises(AttributeError):
        recipe.lr = 1.0
    assert Recipe().clip == 1.0 and recipe.clip == math.inf


@pytest.mark.parametrize("lr, clip, name", [(0.0, 1.0, "lr"), (math.nan, 1.0, "lr"),
                                            (math.inf, 1.0, "lr"), (1e-3, -1.0, "clip"),
                                            (1e-3, math.nan, "clip"), (1e-3, 0.0, "clip")])
def test_train_step_refuses_a_bad_rate_or_clip_before_touching_the_model(lr, clip, name):
    model = tiny_gpt()
    before = copy.deepcopy(model.state_dict())
    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=name):
        train_step(model, make_optimizer(model, Recipe()), x, x, lr, clip)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_held_out_loss_restores_the_mode_when_the_model_raises():
    model = tiny_gpt(dropout=0.5).train()
    too_long = torch.zeros(1, 9, dtype=torch.long)  # the context is 8
    with pytest.raises(ValueError):
        held_out_loss(model, too_long, too_long)
    assert model.training


def test_no_two_runs_share_a_batch_stream_at_any_step():
    # batch seeded seed * 1_000_003 + step: (seed 0, step 1_000_003) drew (seed 1, step 0)'s batch;
    # seeded seed * 2**32 + step, every seed drew seed 0's batches (a CPU generator keeps 32 bits)
    ids = torch.arange(100_000)
    for (seed, step), (other_seed, other_step) in [((0, 1_000_003), (1, 0)), ((1, 1_000_005), (2, 2)),
                                                   ((0, 7), (1, 7)), ((0, 7), (4095, 7)),
                                                   ((0, 2**20 - 1), (1, 0))]:
        assert not torch.equal(batch(ids, step, 8, 16, seed)[0],
                               batch(ids, other_step, 8, 16, other_seed)[0])


def test_seed_zero_draws_the_batches_it_always_drew():
    # the book's runs (seed 0): each step's generator is seeded with the step, as before the fix
    ids = torch.arange(5_000)
    for step in (0, 1, 799, 1_000_003):
        starts = torch.randint(5_000 - 12, (4,), generator=torch.Generator().manual_seed(step))
        assert torch.equal(batch(ids, step, 4, 12)[0][:, 0], starts)


@pytest.mark.parametrize("args, name, most", [((2**20, 0), "step", 2**20 - 1),
                                              ((0, 2**12), "seed", 2**12 - 1)])
def test_batch_refuses_a_step_or_seed_past_its_bits_by_name(args, name, most):
    # torch.Generator().manual_seed keeps the low 32 bits of a seed (manual_seed(2**32 + 7) draws
    # as manual_seed(7)): 12 bits for the seed and 20 for the step make one seed per (seed, step)
    with pytest.raises(ValueError, match=f"^{name} must be at most {most}, got {name}="):
        batch(torch.arange(100), args[0], 2, 3, args[1])
    assert batch(torch.arange(100), 2**20 - 1, 2, 3, 2**12 - 1)[0].shape == (2, 3)


def test_a_cpu_generator_keeps_32_bits_of_its_seed():
    # the fact batch's seeding rests on, on the PyTorch this runs
    draw = [torch.randint(1000, (4,), generator=torch.Generator().manual_seed(s))
            for s in (7, 2**32 + 7)]
    assert torch.equal(*draw)


@pytest.mark.parametrize("args, error, name", [
    ((torch.arange(10), 1, 2, 10), ValueError, "context"),  # no window of 11 in 10 ids
    ((torch.arange(10), 1, 2, 0), ValueError, "context"),
    ((torch.arange(10), 1, 0, 3), ValueError, "size"),
    ((torch.arange(10), -1, 2, 3), ValueError, "step"),
    ((torch.arange(10), 1.0, 2, 3), TypeError, "step"),
    ((torch.arange(10), 1, 2, 3, -1), ValueError, "seed"),
    ((torch.arange(10).reshape(2, 5), 1, 2, 3), TypeError, "ids"),
    ((list(range(10)), 1, 2, 3), TypeError, "ids"),
])
def test_batch_refuses_what_gives_no_windows_by_name(args, error, name):
    with pytest.raises(error, match=name):
        batch(*args)


@pytest.mark.parametrize("call", [lambda: learning_rate(None, 1, 5),
                                  lambda: make_optimizer(torch.nn.Linear(1, 1), None),
                                  lambda: held_out_split(torch.tensor(5), 1, 2)])
def test_a_missing_recipe_or_a_0d_text_is_named(call):
    with pytest.raises((TypeError, ValueError), match="recipe|ids"):
        call()
