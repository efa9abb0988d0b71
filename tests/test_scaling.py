"""attnbook.scaling (chapter 2) against PyTorch, written-out formulas and sampling theory."""

import re

import numpy as np
import pytest
import torch

from attnbook.attention import softmax
from attnbook.scaling import (
    random_scores,
    softmax_jacobian,
    softmax_jacobian_norm,
    softmax_peak,
)

SEED_TABLE = {  # the source's figures (seed 002): d -> (unscaled, scaled)
    4: (0.549, 0.359),
    16: (0.749, 0.356),
    64: (0.858, 0.358),
    256: (0.928, 0.368),
}


def torch_jacobian(row: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(row)
    return torch.autograd.functional.jacobian(lambda s: torch.softmax(s, -1), x).numpy()


def torch_peaks(d: int, scaled: bool, trials: int, num_keys: int = 8, seed: int = 0):
    """Per-trial peaks from PyTorch's own generator: an independent sample of the experiment."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(trials, 1, d, dtype=torch.float64, generator=gen)
    k = torch.randn(trials, num_keys, d, dtype=torch.float64, generator=gen)
    s = (q @ k.transpose(1, 2))[:, 0] / (d**0.5 if scaled else 1.0)
    return torch.softmax(s, -1).amax(-1).numpy()


# --- random_scores -------------------------------------------------------------------------


@pytest.mark.parametrize("d, num_keys, trials", [(1, 1, 1), (3, 5, 7), (16, 8, 100)])
def test_random_scores_is_the_written_out_experiment(d, num_keys, trials):
    s = random_scores(d, num_keys, trials, scaled=False, seed=3)
    rng = np.random.default_rng(3)  # one block: queries, then keys
    q, k = rng.standard_normal((trials, d)), rng.standard_normal((trials, num_keys, d))
    expected = [[sum(q[t, i] * k[t, j, i] for i in range(d)) for j in range(num_keys)]
                for t in range(trials)]
    assert s.shape == (trials, num_keys) and s.dtype == np.float64
    np.testing.assert_allclose(s, expected, rtol=1e-10, atol=1e-12)


def test_random_scores_seeds_and_scaling():
    a = random_scores(64, trials=500, scaled=False, seed=5)
    np.testing.assert_array_equal(a, random_scores(64, trials=500, scaled=False, seed=5))
    np.testing.assert_array_equal(random_scores(64, trials=500, scaled=True, seed=5), a / 8)
    assert not np.array_equal(a, random_scores(64, trials=500, scaled=False, seed=6))
    # numpy integers are integers too
    np.testing.assert_array_equal(random_scores(np.int64(64), trials=np.int32(500),
                                                scaled=np.bool_(False), seed=5), a)


def test_random_scores_blocks_for_large_d_stay_independent():
    # d = 4096 and 8 keys: several blocks; every trial must still be fresh
    s = random_scores(4096, trials=600, scaled=True, seed=1)
    assert s.shape == (600, 8) and len(np.unique(s)) == s.size
    per_trial = (s**2).mean(axis=1)
    assert abs(per_trial.mean() - 1) < 4 * per_trial.std(ddof=1) / np.sqrt(600)


@pytest.mark.parametrize("d", [1, 4, 32, 256])
def test_variance_of_a_dot_product_is_d(d):
    s = random_scores(d, trials=4000, scaled=False, seed=d)
    per_trial = (s**2).mean(axis=1)
    assert abs(per_trial.mean() / d - 1) < 4 * per_trial.std(ddof=1) / np.sqrt(4000) / d


# --- softmax_peak --------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 8, 64])
@pytest.mark.parametrize("scaled", [False, True])
def test_softmax_peak_same_draws_as_torch(d, scaled):
    scores = torch.from_numpy(random_scores(d, trials=2000, scaled=scaled, seed=2))
    expected = torch.softmax(scores, -1).amax(-1).mean().item()
    assert softmax_peak(d, trials=2000, scaled=scaled, seed=2) == pytest.approx(expected, 1e-12)


@pytest.mark.parametrize("d, scaled", [(4, False), (64, False), (16, True), (256, True)])
def test_softmax_peak_agrees_with_an_independent_torch_sample(d, scaled):
    theirs = torch_peaks(d, scaled, trials=5000, seed=d)
    se = np.sqrt(2) * theirs.std(ddof=1) / np.sqrt(theirs.size)
    assert abs(softmax_peak(d, trials=5000, scaled=scaled, seed=1) - theirs.mean()) < 4 * se


@pytest.mark.parametrize("d", sorted(SEED_TABLE))
def test_softmax_peak_reproduces_the_seed_table(d):
    # Our defaults (10,000 trials) have a standard error of about 0.002. The source's figures
    # are noisier (chapter 2 estimates they come from about 200 trials), so the tolerance is
    # three standard errors of the difference of a 10,000-trial and a 200-trial estimate.
    for scaled, figure in zip((False, True), SEED_TABLE[d]):
        peaks = softmax(random_scores(d, scaled=scaled)).max(-1)
        ours = softmax_peak(d, scaled=scaled)
        assert ours == pytest.approx(float(peaks.mean()), abs=1e-15)
        tolerance = 3 * peaks.std(ddof=1) * np.sqrt(1 / 10_000 + 1 / 200) + 0.0005
        assert abs(ours - figure) < tolerance


def test_softmax_peak_shape_of_the_curves():
    unscaled = [softmax_peak(d, trials=3000, scaled=False) for d in (4, 16, 64, 256)]
    scaled = [softmax_peak(d, trials=3000, scaled=True) for d in (16, 64, 256, 1024)]
    assert np.all(np.diff(unscaled) > 0.05)
    assert np.ptp(scaled) < 0.02 and all(0.33 < p < 0.39 for p in scaled)
    assert softmax_peak(1, scaled=True, trials=500) == softmax_peak(1, scaled=False, trials=500)


def test_softmax_peak_bounds_and_single_key():
    assert softmax_peak(32, num_keys=1, trials=10) == 1.0
    for n in (2, 5, 40):
        p = softmax_peak(16, num_keys=n, trials=300)
        assert 1 / n < p < 1


# --- softmax_jacobian ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_softmax_jacobian_matches_autograd(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 5, size=rng.integers(0, 3))) + (
        int(rng.integers(1, 10)),)
    s = rng.normal(scale=10.0 ** rng.uniform(-1, 1.5), size=shape)
    expected = np.stack([torch_jacobian(r) for r in s.reshape(-1, shape[-1])])
    ours = softmax_jacobian(s)
    assert ours.shape == shape + shape[-1:]
    np.testing.assert_allclose(ours, expected.reshape(ours.shape), atol=1e-15)


def test_softmax_jacobian_properties():
    rng = np.random.default_rng(0)
    J = softmax_jacobian(rng.normal(size=(20, 7)))
    np.testing.assert_allclose(J, np.swapaxes(J, -1, -2))  # symmetric
    np.testing.assert_allclose(J.sum(-1), 0, atol=1e-15)  # rows sum to 0
    assert np.all(np.linalg.eigvalsh(J) > -1e-12)  # positive semi-definite
    np.testing.assert_array_equal(softmax_jacobian(np.array([3.0])), [[0.0]])  # one key


def test_softmax_jacobian_saturated_masked_and_dtypes():
    assert np.abs(softmax_jacobian(np.array([0.0, 50.0, -3.0]))).max() < 1e-20
    masked = softmax_jacobian(np.array([[1.0, -np.inf, 2.0], [-np.inf, -np.inf, -np.inf]]))
    assert not np.isnan(masked).any()
    assert (masked[0, 1] == 0).all() and (masked[0, :, 1] == 0).all() and (masked[1] == 0).all()
    np.testing.assert_allclose(masked[0][np.ix_([0, 2], [0, 2])],
                               softmax_jacobian(np.array([1.0, 2.0])))
    x = np.array([0.5, -1.0, 2.0])
    for dtype, tol in [(np.float32, 1e-6), (np.float16, 2e-3)]:
        J = softmax_jacobian(x.astype(dtype))
        assert J.dtype == dtype
        np.testing.assert_allclose(J.astype(np.float64), softmax_jacobian(x), atol=tol)
    np.testing.assert_allclose(softmax_jacobian([1, 2, 3]), softmax_jacobian([1.0, 2.0, 3.0]))


# --- softmax_jacobian_norm -----------------------------------------------------------------


@pytest.mark.parametrize("d, scaled", [(2, False), (64, False), (64, True)])
def test_softmax_jacobian_norm_matches_autograd(d, scaled):
    scores = random_scores(d, trials=150, scaled=scaled, seed=4)
    expected = np.mean([np.linalg.norm(torch_jacobian(row)) for row in scores])
    ours = softmax_jacobian_norm(d, trials=150, scaled=scaled, seed=4)
    assert ours == pytest.approx(expected, rel=1e-12)


def test_softmax_jacobian_norm_blocks():
    # 400 keys: 13 trials per block, so 40 trials span several blocks
    scores = random_scores(4, num_keys=400, trials=40, seed=0)
    expected = np.mean([np.linalg.norm(softmax_jacobian(row)) for row in scores])
    assert softmax_jacobian_norm(4, num_keys=400, trials=40) == pytest.approx(expected, 1e-12)


def test_unscaled_gradient_at_256_is_much_smaller():
    unscaled = softmax_jacobian_norm(256, trials=3000, scaled=False)
    scaled = softmax_jacobian_norm(256, trials=3000, scaled=True)
    assert unscaled < 0.3 * scaled
    assert softmax_jacobian_norm(1, num_keys=1, trials=5) == 0.0


# --- bad input -----------------------------------------------------------------------------

BAD_ARGUMENTS = [
    (dict(d=0), ValueError, "d must be at least 1, got d=0"),
    (dict(d=-3), ValueError, "d must be at least 1, got d=-3"),
    (dict(d=2.5), TypeError, "d must be an int, got d=2.5 of type float"),
    (dict(d=4.0), TypeError, "d must be an int, got d=4.0 of type float"),
    (dict(d="4"), TypeError, "d must be an int, got d='4' of type str"),
    (dict(d=True), TypeError, "d must be an int, got d=True of type bool"),
    (dict(d=None), TypeError, "d must be an int, got d=None of type NoneType"),
    (dict(d=4, num_keys=0), ValueError, "num_keys must be at least 1, got num_keys=0"),
    (dict(d=4, num_keys=2.0), TypeError, "num_keys must be an int, got num_keys=2.0 of type float"),
    (dict(d=4, trials=0), ValueError, "trials must be at least 1, got trials=0"),
    (dict(d=4, trials=1e4), TypeError, "trials must be an int, got trials=10000.0 of type float"),
    (dict(d=4, scaled="yes"), TypeError,
     "scaled must be True or False, got scaled='yes' of type str"),
    (dict(d=4, scaled=1), TypeError, "scaled must be True or False, got scaled=1 of type int"),
    (dict(d=4, seed=-1), ValueError, "seed must be at least 0, got seed=-1"),
    (dict(d=4, seed=0.5), TypeError, "seed must be an int, got seed=0.5 of type float"),
]


@pytest.mark.parametrize("function", [random_scores, softmax_peak, softmax_jacobian_norm])
@pytest.mark.parametrize("kwargs, error, message", BAD_ARGUMENTS)
def test_bad_arguments_name_themselves(function, kwargs, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        function(**kwargs)


@pytest.mark.parametrize("scores, error, match", [
    (np.float64(1.0), ValueError, r"scores must have shape \(\.\.\., n\).*got shape \(\)"),
    (np.zeros((3, 0)), ValueError, r"scores must have shape .* got shape \(3, 0\)"),
    (np.array(["a", "b"]), TypeError, "scores must hold real numbers, got scores of dtype <U1"),
    (np.array([1 + 2j]), TypeError,
     "scores must hold real numbers, got scores of dtype complex128"),
    (np.array([True, False]), TypeError, "scores must hold real numbers, got scores of dtype bool"),
])
def test_softmax_jacobian_bad_input(scores, error, match):
    with pytest.raises(error, match=match):
        softmax_jacobian(scores)


def test_softmax_jacobian_of_non_finite_scores_is_nan_not_zero():
    # A NaN or inf score is an error upstream, not a masked key: it must show
    with np.errstate(invalid="ignore"):
        for row in ([np.nan, 1.0, 2.0], [np.inf, 1.0, 2.0]):
            assert np.isnan(softmax_jacobian(np.array(row))).all()
    assert not np.isnan(softmax_jacobian(np.array([-np.inf, 1.0]))).any()  # masked: zeros


def test_softmax_jacobian_of_float16_is_computed_in_float32():
    x = np.random.default_rng(3).normal(scale=4.0, size=(50, 8)).astype(np.float16)
    jacobian = softmax_jacobian(x)
    assert jacobian.dtype == np.float16
    np.testing.assert_array_equal(jacobian,
                                  softmax_jacobian(x.astype(np.float32)).astype(np.float16))
