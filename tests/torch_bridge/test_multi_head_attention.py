"""``F.multi_head_attention_forward`` called with a model's own weights (WavLM: separate q/k/v projections,
a float position bias per head as ``attn_mask``, a key padding mask): output, attention weights and
gradients equal PyTorch's under ``jit``."""

import torch
import torch.nn.functional as F
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class GatedPositionAttention(nn.Module):
    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Linear(width, width),
        )
        self.out_proj = nn.Linear(width, width)
        self.position_bias = nn.Parameter(torch.randn(heads, 5, 5))

    def forward(self, hidden, padding):
        x = hidden.transpose(0, 1)
        out, weights = F.multi_head_attention_forward(
            x,
            x,
            x,
            x.shape[-1],
            self.heads,
            torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
            None,
            None,
            False,
            0.0,
            self.out_proj.weight,
            self.out_proj.bias,
            False,
            padding,
            need_weights=True,
            attn_mask=self.position_bias.repeat(hidden.shape[0], 1, 1),
            use_separate_proj_weight=True,
            q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
        )
        return out.transpose(0, 1) + weights.sum(-1, keepdim=True).mean(1, keepdim=True).transpose(1, 2)


def test_wavlm_style_call_matches_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = GatedPositionAttention()
    hidden = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 4 + [True], [False] * 5])
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(
        module,
        converted,
        lambda m: m(hidden, padding).square().sum(),
        lambda m: (m(to_jax(hidden), to_jax(padding)) ** 2).sum(),
        rtol=1e-4,
    )
