"""Losses and attention lowered to JAX: values and input gradients equal torch's."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import jmp.torch_bridge  # noqa: F401  (fills the lowering registry)
from jmp.torch_bridge import dispatch
from jmp.torch_bridge.tensor import JaxTensor, unwrap
from tests.helpers import assert_close, to_jax


def _lowered(fn, *tensors, **kwargs):
    """``fn`` on JaxTensors, as a JAX function of the tensors' arrays."""

    def run(*arrays):
        with dispatch.session():
            return unwrap(fn(*[JaxTensor(a) for a in arrays], **kwargs))

    return run


def _check(fn, tensors, grad_of=(0,), rtol=1e-5, **kwargs):
    leaves = [t.detach().clone().requires_grad_(i in grad_of) for i, t in enumerate(tensors)]
    expected = fn(*leaves, **kwargs)
    expected.sum().backward()
    run = _lowered(fn, **kwargs)
    arrays = [to_jax(t) for t in tensors]
    assert_close(run(*arrays), expected, rtol)
    grads = jax.grad(lambda *a: jnp.sum(run(*a)), argnums=grad_of)(*arrays)
    for index, grad in zip(grad_of, grads):
        assert_close(grad, leaves[index].grad, rtol)


LOGITS = torch.randn(6, 5)
TARGETS = torch.tensor([0, 4, -100, 2, 2, 1])  # one ignored position


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"label_smoothing": 0.1},
        {"weight": torch.rand(5), "label_smoothing": 0.2},
        {"reduction": "sum", "label_smoothing": 0.1},
        {"reduction": "none"},
    ],
)
def test_cross_entropy_with_ignore_index_weights_and_smoothing(kwargs):
    _check(F.cross_entropy, [LOGITS, TARGETS], **kwargs)


def test_cross_entropy_with_probability_targets_and_spatial_dims():
    _check(F.cross_entropy, [torch.randn(2, 5, 3), torch.softmax(torch.randn(2, 5, 3), 1)], label_smoothing=0.05)
    _check(F.cross_entropy, [torch.randn(2, 5, 3), torch.randint(0, 5, (2, 3))])


def test_nll_mse_and_binary_cross_entropy_with_logits():
    _check(F.nll_loss, [torch.log_softmax(LOGITS, 1), TARGETS], weight=torch.rand(5))
    _check(F.mse_loss, [torch.randn(4, 3), torch.randn(4, 3)], grad_of=(0, 1))
    _check(
        F.binary_cross_entropy_with_logits,
        [torch.randn(4, 3), torch.rand(4, 3)],
        grad_of=(0, 1),
        pos_weight=torch.rand(3) * 3,
    )


Q, K, V = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"is_causal": True},
        {"attn_mask": torch.rand(6, 6) > 0.3},
        {"attn_mask": torch.randn(2, 1, 6, 6)},
        {"scale": 0.2},
    ],
)
def test_scaled_dot_product_attention_matches_torch(kwargs):
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        mask[:, 0] = True  # every query attends somewhere
    _check(F.scaled_dot_product_attention, [Q, K, V], grad_of=(0, 1, 2), rtol=1e-4, **kwargs)


def test_grouped_query_attention_and_longer_keys():
    _check(
        F.scaled_dot_product_attention,
        [Q, K[:, :2], V[:, :2]],
        grad_of=(0, 1, 2),
        rtol=1e-4,
        enable_gqa=True,
    )
    _check(F.scaled_dot_product_attention, [Q[:, :, :3], K, V], grad_of=(0, 1, 2), rtol=1e-4, is_causal=True)


def test_values_with_another_head_size_than_queries():
    # multi-head latent attention (DeepSeek-V3, ...): queries and keys 192 wide, values 128
    value = torch.randn(*V.shape[:-1], V.shape[-1] + 3)
    _check(F.scaled_dot_product_attention, [Q, K, value], grad_of=(0, 1, 2), rtol=1e-4, is_causal=True)


def test_grouped_expert_matmul_lowers_to_ragged_dot():
    tokens, weights = torch.randn(7, 4), torch.randn(3, 4, 5)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)  # the middle expert gets no tokens
    expected = torch.cat([tokens[:2] @ weights[0], tokens[2:] @ weights[2]])
    run = _lowered(lambda a, b, o: torch._grouped_mm(a, b, offs=o))
    arrays = (to_jax(tokens), to_jax(weights), to_jax(offsets))
    assert_close(run(*arrays), expected)
    assert "ragged_dot" in str(jax.make_jaxpr(run)(*arrays))


def test_sdpa_lowering_uses_jax_dot_product_attention(monkeypatch):
    calls = []
    original = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **k: calls.append(k) or original(*a, **k))
    _lowered(F.scaled_dot_product_attention)(to_jax(Q), to_jax(K), to_jax(V))
    assert len(calls) == 1


CTC_LOG_PROBS = torch.randn(12, 3, 6).log_softmax(-1)  # (time, batch, classes)
CTC_TARGETS = torch.tensor([[1, 2, 2, 5], [3, 1, 0, 0], [4, 4, 4, 0]])
CTC_TARGET_LENGTHS = torch.tensor([4, 2, 3])


def test_ctc_loss_matches_torch():
    # Wav2Vec2-CTC passes the targets concatenated (labels.masked_select(mask)), lengths per sequence
    concatenated = torch.cat([t[:n] for t, n in zip(CTC_TARGETS, CTC_TARGET_LENGTHS)])
    lengths = (torch.tensor([12, 9, 7]), CTC_TARGET_LENGTHS)

    def losses(log_probs):
        mean = F.ctc_loss(log_probs, concatenated, *lengths, blank=0)
        total = F.ctc_loss(log_probs, CTC_TARGETS, *lengths, blank=0, reduction="sum")
        each = F.ctc_loss(log_probs, CTC_TARGETS, *lengths, blank=0, reduction="none")
        return torch.cat([torch.stack([mean, total]), each.square()])

    leaf = CTC_LOG_PROBS.clone().requires_grad_()
    expected = losses(leaf)
    expected.sum().backward()
    run = _lowered(losses)

    def total(log_probs):
        values = run(log_probs)
        return values.sum(), values

    # compiled: optax's CTC is a scan over time steps, slow op by op
    (_, actual), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(to_jax(CTC_LOG_PROBS))
    assert_close(actual, expected, 1e-4)
    assert_close(grad, leaf.grad, 1e-4)


def test_ctc_loss_without_an_alignment_is_infinite_or_zero():
    # 4 repeated labels need 7 steps; 3 steps fit none
    log_probs, targets = CTC_LOG_PROBS[:3, :1], torch.tensor([[2, 2, 2, 2]])
    args = (torch.tensor([3]), torch.tensor([4]))
    for zero_infinity in (False, True):
        expected = F.ctc_loss(log_probs, targets, *args, reduction="sum", zero_infinity=zero_infinity)
        actual = jax.jit(_lowered(F.ctc_loss, reduction="sum", zero_infinity=zero_infinity))(
            to_jax(log_probs), to_jax(targets), *map(to_jax, args)
        )
        assert float(actual) == float(expected)
