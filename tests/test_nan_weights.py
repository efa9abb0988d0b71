"""Non-finite input never gives a finite answer: a NaN in a GPT's query
projection gives NaN logits on every backend and variant. PyTorch's SDPA on the CPU breaks this
on the `sdpa` backend without a mask: its flash kernel (chosen for is_causal and for no mask)
turns a query row of NaN scores into a finite row when the row has fewer than 8 keys in float32
(on the machine measured; the models here have 7 tokens), where the explicit and masked kernels
give NaN (appendix H prints 4 and 16 keys). A guard in chapter 3's `_sdpa_attention` (NaN where q is not finite) would
keep it; measured at one thread, it slowed the chapter-size training step 8.6% and generation
20%, so it is not applied: the case is recorded here as an expected failure."""

import pytest
import torch
import torch.nn.functional as F
from test_variants import model

pytestmark = pytest.mark.usefixtures("one_thread")

CPU_SDPA_DROPS_NAN = pytest.mark.xfail(
    strict=True, reason="F4: PyTorch's CPU flash SDPA gives a finite row for a NaN query with < 8 keys")


def test_the_same_sdpa_call_with_its_mask_written_out_keeps_the_nan():
    # what the guard would not need: the kernels SDPA takes for an explicit mask give NaN
    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    q[0, 0, 1, 3] = float("nan")
    for mask in (torch.ones(4, 4, dtype=torch.bool).tril(), torch.ones(4, 4, dtype=torch.bool)):
        assert F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 0, 1].isnan().all()


def nan_query_logits(name: str, backend: str) -> torch.Tensor:
    gpt = model(name, backend=backend, d_model=64)  # heads of 16: the Triton kernel takes them
    with torch.no_grad():
        gpt.blocks[0].self_attn.q_proj.weight[0, 0] = float("nan")
        return gpt(torch.randint(40, (2, 7), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("backend", [
    "explicit", pytest.param("sdpa", marks=CPU_SDPA_DROPS_NAN), "triton"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_nan_query_weight_gives_nan_logits(name, backend):
    assert nan_query_logits(name, backend).isnan().all()


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "triton"])
@pytest.mark.parametrize("name", ["alibi", "bloom"])
def test_alibi_keeps_a_nan_query_weights_nan(name, backend):
    # ALiBi's bias goes to SDPA as a mask, whose kernel keeps the NaN on every backend
    assert nan_query_logits(name, backend).isnan().all()
