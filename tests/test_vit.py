"""Tests of attnbook.vit (chapter 18) against PyTorch's unfold, convolution and encoder layers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnbook.layers import from_torch_encoder_layer
from attnbook.vit import ViT, ViTConfig, patchify

DOUBLE = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def _small(**changes) -> ViTConfig:
    sizes = dict(image_size=8, patch_size=2, in_channels=3, num_classes=5, d_model=16,
                 num_layers=2, num_heads=4, d_ff=32)
    return ViTConfig(**{**sizes, **changes})


def _by_hand(images, p):
    """Row-major patches, each read channel by channel, row by row, column by column."""
    b, c, h, w = images.shape
    rows = []
    for n in range(b):
        rows.append([[images[n, ch, i * p + r, j * p + s].item()
                      for ch in range(c) for r in range(p) for s in range(p)]
                     for i in range(h // p) for j in range(w // p)])
    return torch.tensor(rows, dtype=images.dtype)


# patchify ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "p"), [
    ((2, 1, 8, 8), 2), ((3, 3, 6, 4), 2), ((1, 3, 9, 6), 3), ((2, 1, 4, 12), 4),
    ((1, 2, 5, 5), 1), ((2, 3, 8, 8), 8), ((1, 1, 1, 1), 1), ((0, 3, 4, 4), 2)])
def test_patchify_matches_unfold(shape, p):
    images = torch.randn(*shape)
    ours = patchify(images, p)
    b, c, h, w = shape
    assert ours.shape == (b, (h // p) * (w // p), c * p * p)
    assert torch.equal(ours, F.unfold(images, p, stride=p).transpose(1, 2))


@pytest.mark.parametrize(("shape", "p"), [((2, 3, 6, 4), 2), ((1, 1, 6, 9), 3)])
def test_patchify_matches_loop(shape, p):
    images = torch.randn(*shape, dtype=DOUBLE)
    assert torch.equal(patchify(images, p), _by_hand(images, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, DOUBLE])
def test_patchify_keeps_dtype_and_nan(dtype):
    images = torch.randn(2, 3, 4, 4).to(dtype)
    images[1, 2, 3, 0] = float("nan")
    out = patchify(images, 2)
    assert out.dtype == dtype
    assert out.isnan().sum() == 1 and out[1, 2, 2 * 4 + 1 * 2 + 0].isnan()  # patch (1, 0)


def test_patchify_noncontiguous_input():
    images = torch.randn(2, 8, 6, 3).permute(0, 3, 1, 2)  # channels last in memory
    assert torch.equal(patchify(images, 2), F.unfold(images, 2, stride=2).transpose(1, 2))


@pytest.mark.parametrize(("images", "p", "error", "match"), [
    (torch.zeros(1, 1, 8, 6), 4, ValueError, "patch_size"),
    (torch.zeros(1, 1, 6, 8), 4, ValueError, "patch_size"),
    (torch.zeros(1, 1, 8, 8), 0, ValueError, "patch_size"),
    (torch.zeros(1, 1, 8, 8), 2.0, TypeError, "patch_size"),
    (torch.zeros(1, 1, 8, 8), True, TypeError, "patch_size"),
    (torch.zeros(8, 8), 2, ValueError, "images"),
    (torch.zeros(1, 1, 8, 8, dtype=torch.long), 2, TypeError, "images"),
    # R4-57 #13: integer images (uint8, the usual image dtype) are refused by name, as the
    # docstring says: patchify takes the floating-point images the model takes
    (torch.zeros(1, 1, 8, 8, dtype=torch.uint8), 2, TypeError,
     r"images must be a floating-point tensor, got dtype torch\.uint8"),
    ([[0.0]], 1, TypeError, "images"),
])
def test_patchify_refuses(images, p, error, match):
    with pytest.raises(error, match=match):
        patchify(images, p)


# ViTConfig and ViT ------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(patch_size=3), ValueError, "patch_size"), (dict(d_model=18), ValueError, "num_heads"),
    (dict(num_layers=0), ValueError, "num_layers"), (dict(image_size=8.0), TypeError, "image_size"),
    (dict(dropout=-0.1), ValueError, "dropout"), (dict(eps=0.0), ValueError, "eps"),
    (dict(num_classes=True), TypeError, "num_classes")])
def test_config_refuses(changes, error, match):
    with pytest.raises(error, match=match):
        _small(**changes)


def test_config_defaults_are_vit_base_16():
    c = ViTConfig()
    assert (c.image_size, c.patch_size, c.d_model, c.num_layers, c.num_heads, c.d_ff) == \
        (224, 16, 768, 12, 12, 3072) and c.num_patches == 196
    with torch.device("meta"):
        assert sum(p.numel() for p in ViT(c).parameters()) == 86_567_656


def test_config_is_frozen_and_replace_gives_consistent_sizes():
    """The sizes that follow from the fields are properties: dataclasses.replace keeps them in
    step, and a model built from the new config has tables of the new sizes."""
    c = _small()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.patch_size = 4
    wider = dataclasses.replace(c, d_model=24, num_heads=2, patch_size=4, in_channels=1,
                                dropout=0.25, backend="explicit")
    assert (wider.num_patches, wider.patch_dim, wider.head_dim) == (4, 16, 12)
    block = wider.block
    assert (block.d_model, block.num_heads, block.d_ff, block.dropout, block.backend) == \
        (24, 2, 32, 0.25, "explicit")
    assert block.norm_first and block.attention.head_dim == 12
    model = ViT(wider)
    assert model.position.shape == (1, 5, 24) and model.patch_embed.in_features == 16
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 5)
    with pytest.raises(ValueError, match="image_size=8 is not divisible by patch_size=3"):
        dataclasses.replace(c, patch_size=3)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("patch_size", [1, 2, 4, 8])
def test_output_shape_and_weights(batch, patch_size):
    config = _small(patch_size=patch_size)
    model = ViT(config).eval()
    logits, weights = model(torch.randn(batch, 3, 8, 8), return_weights=True)
    n = config.num_patches + 1
    assert logits.shape == (batch, 5) and len(weights) == 2
    for w in weights:
        assert w.shape == (batch, 4, n, n)
        torch.testing.assert_close(w.sum(-1), torch.ones(batch, 4, n))
    assert model(torch.zeros(batch, 3, 8, 8)).isfinite().all()


def test_matches_pytorch_modules():
    """Our ViT against one built from nn.Conv2d and nn.TransformerEncoderLayer, in float64."""
    torch.manual_seed(0)
    c = _small(in_channels=2, image_size=6, patch_size=3, num_layers=3)
    conv = nn.Conv2d(2, 16, 3, stride=3, dtype=DOUBLE)
    layers = [nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu",
                                         layer_norm_eps=c.eps, batch_first=True, norm_first=True,
                                         dtype=DOUBLE).eval() for _ in range(3)]
    norm, head = nn.LayerNorm(16, eps=c.eps, dtype=DOUBLE), nn.Linear(16, 5, dtype=DOUBLE)
    for module in (conv, *layers, norm, head):
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.3)
    ours = ViT(c).double().eval()
    with torch.no_grad():
        ours.cls_token.normal_()
        ours.position.normal_()
        ours.patch_embed.weight.copy_(conv.weight.flatten(1))
        ours.patch_embed.bias.copy_(conv.bias)
    ours.blocks = nn.ModuleList(from_torch_encoder_layer(layer) for layer in layers)
    ours.norm.load_state_dict(norm.state_dict())
    ours.head.load_state_dict(head.state_dict())
    images = torch.randn(4, 2, 6, 6, dtype=DOUBLE)
    x = conv(images).flatten(2).transpose(1, 2)
    x = torch.cat([ours.cls_token.expand(4, -1, -1), x], dim=1) + ours.position
    for layer in layers:
        x = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), head(norm(x[:, 0])), rtol=0, atol=1e-12)


def _shuffle(images, p, perm):
    b, c, h, w = images.shape
    x = patchify(images, p)[:, perm].view(b, h // p, w // p, c, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def test_positions_are_what_sees_patch_order():
    torch.manual_seed(0)
    model = ViT(_small()).double().eval()
    with torch.no_grad():
        model.position.normal_()
    images = torch.randn(3, 3, 8, 8, dtype=DOUBLE)
    perm = torch.randperm(16)
    shuffled = _shuffle(images, 2, perm)
    assert not torch.equal(shuffled, images)
    with torch.no_grad():
        assert (model(shuffled) - model(images)).abs().max() > 1e-3
        model.position[:, 1:] = model.position[:, 1:2]  # the same position for every patch
        torch.testing.assert_close(model(shuffled), model(images), rtol=0, atol=1e-12)


def test_class_token_position_matters():
    """The head reads position 0, the class token: changing the class token's position vector
    moves the logits; adding the same constant to all its features does not (LayerNorm)."""
    torch.manual_seed(0)
    model = ViT(_small()).double().eval()
    images = torch.randn(2, 3, 8, 8, dtype=DOUBLE)
    with torch.no_grad():
        before = model(images)
        model.position[:, 0] += 1.0  # a shift along (1, ..., 1): every LayerNorm removes it
        torch.testing.assert_close(model(images), before, rtol=0, atol=1e-12)
        model.position[:, 0] += torch.randn(16, dtype=DOUBLE)
        assert (model(images) - before).abs().max() > 1e-3


def test_gradient_reaches_every_parameter():
    torch.manual_seed(0)
    model = ViT(_small())
    loss = F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    images = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(images).sum().backward()
    assert images.grad.abs().sum() > 0


def test_nan_propagates():
    model = ViT(_small()).eval()
    images = torch.randn(2, 3, 8, 8)
    images[1, 0, 5, 5] = float("nan")
    with torch.no_grad():
        logits = model(images)
    assert logits[1].isnan().all() and logits[0].isfinite().all()


def test_dropout_only_in_training():
    model = ViT(_small(dropout=0.5))
    images = torch.randn(2, 3, 8, 8)
    model.eval()
    assert torch.equal(model(images), model(images))
    model.train()
    torch.manual_seed(0)
    assert not torch.equal(model(images), model(images))


@pytest.mark.parametrize(("images", "error", "match"), [
    (torch.zeros(2, 1, 8, 8), ValueError, "images"), (torch.zeros(2, 3, 8, 6), ValueError, "images"),
    (torch.zeros(3, 8, 8), ValueError, "images"),
    (torch.zeros(2, 3, 8, 8, dtype=DOUBLE), TypeError, "images"),
    (torch.zeros(2, 3, 8, 8, dtype=torch.long), TypeError, "images"), ("x", TypeError, "images")])
def test_model_refuses_bad_images(images, error, match):
    with pytest.raises(error, match=match):
        ViT(_small())(images)


def test_model_refuses_bad_config_and_flag():
    with pytest.raises(TypeError, match="config"):
        ViT(dict(image_size=8))
    with pytest.raises(TypeError, match="return_weights"):
        ViT(_small())(torch.zeros(1, 3, 8, 8), return_weights=1)
