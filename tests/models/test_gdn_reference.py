"""The Gated DeltaNet reference: the chunked prompt form against the token-by-token form, at any offset."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.kernels.interface import CHUNK
from app.kernels.reference import delta_rule_chunked, delta_rule_recurrent
from app.models.gdn import l2norm

HEADS, DK, DV = 3, 16, 8


def _inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(length, HEADS, DK, generator=generator, dtype=torch.float64)) * DK**-0.5
    k = l2norm(torch.randn(length, HEADS, DK, generator=generator, dtype=torch.float64))
    v = torch.randn(length, HEADS, DV, generator=generator, dtype=torch.float64)
    g = -F.softplus(torch.randn(length, HEADS, generator=generator, dtype=torch.float64))
    beta = torch.rand(length, HEADS, generator=generator, dtype=torch.float64)
    state = 0.3 * torch.randn(HEADS, DK, DV, generator=generator, dtype=torch.float64)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("offset", [0, 1, 63, 64, 100])
def test_chunked_form_equals_the_recurrent_form_at_any_offset(offset: int) -> None:
    inputs = _inputs(150, seed=offset)
    out, state = delta_rule_chunked(*inputs, offset=offset)
    expected, expected_state = delta_rule_recurrent(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, expected_state, rtol=1e-10, atol=1e-10)


def test_pieces_cut_at_chunk_multiples_regroup_nothing() -> None:
    """Reading a prompt in pieces that end on chunk boundaries runs the chunks of reading it whole."""
    q, k, v, g, beta, state = (t.float() for t in _inputs(2 * CHUNK + 30, seed=9))
    whole, whole_state = delta_rule_chunked(q, k, v, g, beta, state, offset=20)
    cut = CHUNK - 20
    first, mid = delta_rule_chunked(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state, offset=20)
    rest, end = delta_rule_chunked(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], mid, offset=CHUNK)
    torch.testing.assert_close(torch.cat((first, rest)), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(end, whole_state, rtol=1e-6, atol=1e-6)
