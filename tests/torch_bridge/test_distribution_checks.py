"""torch.distributions check their arguments with ``if not torch._is_all_true(valid): raise`` (BLT's patcher
builds a ``Categorical`` in its forward): the bridge lowers torch's private all / any, so a converted forward
that builds a distribution computes what PyTorch does, and bad arguments raise as in PyTorch."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import jmp


class Entropy(nn.Module):
    # validate_args explicitly: torch's default is switched off for the whole process once torch._dynamo starts
    # (another test in the same worker may have compiled something)
    def forward(self, logits, probs):
        return (
            torch.distributions.Categorical(logits=logits, validate_args=True).entropy(),
            torch.distributions.Categorical(probs=probs, validate_args=True),
        )


def test_a_distribution_built_in_a_forward_checks_its_arguments_as_torch_does():
    logits = torch.randn(2, 5)
    converted = jmp.torch_bridge.convert(Entropy())
    expected, _ = Entropy()(logits, torch.full((2, 5), 0.2))
    actual, _ = converted(jnp.asarray(logits.numpy()), jnp.full((2, 5), 0.2))
    np.testing.assert_allclose(np.asarray(actual), expected.numpy(), rtol=1e-5)
    negative = torch.tensor([2.0, -1.0, 0.5, 0.5, 0.5]).expand(2, 5)
    with pytest.raises(ValueError, match="Expected parameter probs"):
        Entropy()(logits, negative)
    with pytest.raises(ValueError, match="Expected parameter probs"):
        converted(jnp.asarray(logits.numpy()), jnp.asarray(negative.numpy()))
