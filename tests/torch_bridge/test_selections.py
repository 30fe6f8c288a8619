"""``masked_select`` with a traced mask (Wav2Vec2-CTC's ``labels.masked_select(labels >= 0)`` feeding
``F.ctc_loss``): the CTC loss and its gradients under ``jit`` equal PyTorch's; any other use of the selection
under ``jit`` is a clear error; with concrete values the selection is torch's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp
from jmp.errors import TracedControlFlowError
from tests.helpers import assert_grad_parity, to_jax


class CTCHead(nn.Module):
    """Hugging Face's CTC loss: labels padded with -100, concatenated by masked_select."""

    def __init__(self, width=6, vocab=5):
        super().__init__()
        self.head = nn.Linear(width, vocab)

    def forward(self, hidden, labels):
        labels_mask = labels >= 0
        target_lengths = labels_mask.sum(-1)
        flattened_targets = labels.masked_select(labels_mask)
        log_probs = F.log_softmax(self.head(hidden), dim=-1, dtype=torch.float32).transpose(0, 1)
        input_lengths = torch.full((hidden.shape[0],), hidden.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, flattened_targets, input_lengths, target_lengths, blank=0)


def test_ctc_loss_on_masked_select_targets_matches_torch_under_jit():
    torch.manual_seed(0)
    module = CTCHead()
    hidden = torch.randn(2, 9, 6)
    labels = torch.tensor([[1, 3, 2, -100], [4, 4, -100, -100]])
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(hidden, labels), lambda m: m(to_jax(hidden), to_jax(labels)))


def test_other_uses_of_a_traced_selection_name_masked_select():
    def mean_of_positives(x):
        with jmp.torch_bridge.dispatch.session():
            t = jmp.torch_bridge.JaxTensor(x)
            return t.masked_select(t > 0).float().mean().value

    with pytest.raises(TracedControlFlowError, match="masked_select under jit"):
        jax.jit(mean_of_positives)(jnp.asarray([1.0, -2.0, 3.0]))


def test_concrete_selection_is_torchs():
    x = torch.tensor([[1.0, -2.0], [3.0, -4.0]])
    with jmp.torch_bridge.dispatch.session():
        t = jmp.torch_bridge.JaxTensor(to_jax(x))
        actual = t.masked_select(t < 0)
    np.testing.assert_array_equal(np.asarray(actual.value), x.masked_select(x < 0).numpy())
