"""``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``, ``orthogonal``): the weight is computed
from its original parameters on every call, as in torch; those parameters keep torch's names
(``parametrizations.weight.original0``), receive the gradients and round-trip ``state_dict()``.
Wav2Vec2's positional convolution is weight-normed this way."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import jmp
from tests.helpers import assert_grad_parity, to_jax


class Parametrized(nn.Module):
    def __init__(self, parametrize):
        super().__init__()
        self.conv = parametrize(nn.Conv1d(4, 4, 3, padding=1))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(torch.tanh(self.conv(x)).transpose(1, 2))


PARAMETRIZATIONS = {
    "weight_norm": lambda m: parametrizations.weight_norm(m, name="weight", dim=2),  # Wav2Vec2's
    "spectral_norm": parametrizations.spectral_norm,
}


@pytest.mark.parametrize("kind", sorted(PARAMETRIZATIONS))
def test_parametrized_weights_match_torch_under_jit(kind):
    torch.manual_seed(0)
    module = Parametrized(PARAMETRIZATIONS[kind]).eval()  # eval: spectral_norm's power iteration stays put
    x = torch.randn(2, 4, 6)
    converted = jmp.torch_bridge.convert(module)
    converted.eval()
    assert_grad_parity(module, converted, lambda m: m(x).square().sum(), lambda m: (m(to_jax(x)) ** 2).sum())


def test_original_parameters_round_trip_state_dict_under_torch_names():
    torch.manual_seed(0)
    module = Parametrized(PARAMETRIZATIONS["weight_norm"])
    converted = jmp.torch_bridge.convert(module)
    state = jmp.torch_bridge.to_state_dict(converted)
    assert list(state) == list(module.state_dict())
    assert "conv.parametrizations.weight.original0" in state  # the norm g; original1 is the direction v
    fresh = Parametrized(PARAMETRIZATIONS["weight_norm"])
    fresh.load_state_dict(state)  # strict
    torch.testing.assert_close(fresh.conv.weight, module.conv.weight)
