"""FP8 training with Transformer Engine's DelayedScaling recipe, against an emulation of the recipe in torch.

The emulation (``tests.precision.te_emulation``) is written from TE's definition, not from jmp's code: torch's fp8 casts
(``torch.float8_e4m3fn`` / ``float8_e5m2``, saturated first as TE's casts are), matmuls in float32, times the
inverse scales; each use records the tensor's amax at the front of a history and the next scale is
``fp8_max / max(history)``. jmp multiplies the same fp8 values, each times its inverse scale before the product
(as XLA's fp8 GEMM pattern has it), in float32, summed in another order: results agree to float32 rounding (1e-6
of the largest).

The tiny LM's tolerance: E4M3 keeps 3 mantissa bits, so each quantised input and weight is off by up to 2**-4
relative (about 1.6% on average); the errors are independent and average out in dot products. Measured over 20
AdamW steps on the benchmark's Markov-chain stream (loss 5.6 -> 3.5), the fp8 losses stay within 0.56% of
float32's (bf16's within 0.02%); the assertion allows 2%. Scales left at 1 (no delayed scaling: small gradients
lose their bits in E5M2) put the run 3.2% off, which it catches. benchmarks/fp8.py runs a Llama for 200 steps.
"""

from __future__ import annotations

import enum
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

import jmp as smp
from benchmarks.fp8 import SPEC, markov_batches
from benchmarks.harness import all_reduce_bytes
from jmp.errors import ConfigError
from jmp.precision import fp8_matmul, fp8_state
from jmp.precision.fp8_autocast import fp8_autocast
from jmp.precision.fp8_matmul import fp8_linear, scaled_matmul
from jmp.precision.fp8_scaling import DelayedScaling
from jmp.remat import xla as remat_xla
from tests.precision.te_emulation import E4M3, E5M2, HISTORY, TorchDelayedScaling, quantised


def _fp8_state(model) -> dict[str, np.ndarray]:
    """The fp8 scales and amax histories by path."""
    flat = nnx.to_flat_state(model.training_state.rest)
    return {"/".join(map(str, path)): np.asarray(v[...]) for path, v in flat if "fp8" in path}


@smp.step
def linear_step(model, x, grad_out):
    out = model(x)
    model.backward((out * grad_out).sum())  # the output's gradient is grad_out itself
    return out


def test_an_fp8_linear_trains_as_te_delayed_scaling_emulated_in_torch():
    smp.init({"fp8": True, "fp8_amax_history_len": HISTORY})
    linear = nn.Linear(32, 16)
    reference = TorchDelayedScaling(linear.weight.detach().clone(), linear.bias.detach().clone())
    model = smp.DistributedModel(linear)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    generator = torch.Generator().manual_seed(3)
    # magnitudes that change from step to step, more steps than the history holds: step 2's inputs overflow the
    # scale step 1 left (saturated), and the largest amax leaves the window at step 6
    for factor in (1.0, 8.0, 0.25, 3.0, 1.0, 0.5):
        x = torch.randn(8, 32, generator=generator) * factor
        grad_out = torch.randn(8, 16, generator=generator) * factor * 1e-3
        optimizer.zero_grad()
        out = linear_step(model, x, grad_out).outputs[0]
        grads = {name: torch.from_numpy(np.array(g)) for name, g in model.layout.by_name(model.grads).items()}
        optimizer.step()
        expected_out, weight_grad, bias_grad, _ = reference.step(x, grad_out)
        torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)
        # each fp8 value times its scale rounds to float32 before the sum: cancelling sums keep that absolute error
        atol = 1e-6 * float(weight_grad.abs().max())
        torch.testing.assert_close(grads["weight"], weight_grad, rtol=1e-6, atol=atol)
        torch.testing.assert_close(grads["bias"], bias_grad, rtol=1e-6, atol=1e-9)
        state = _fp8_state(model)
        for name, scaling in (
            ("input", reference.input),
            ("weight", reference.weight_scaling),
            ("grad", reference.grad),
        ):
            np.testing.assert_allclose(state[f"fp8/{name}_amax_history"], scaling.history, rtol=1e-7)
            np.testing.assert_allclose(state[f"fp8/{name}_scale"], scaling.scale, rtol=1e-7)
    assert reference.input.scale != 1.0 and reference.grad.scale > 1e4  # the scales moved away from their start

    trained = _fp8_state(model)
    model.eval()  # eval mode quantises with the current scales and records nothing
    with torch.no_grad():
        out = model(x * 100)
    q_x, s_x = quantised(x * 100, reference.input.scale, E4M3), reference.input.scale
    q_w, s_w = quantised(reference.weight, reference.weight_scaling.scale, E4M3), reference.weight_scaling.scale
    torch.testing.assert_close(
        out, (q_x @ q_w.T) * ((1 / torch.tensor(s_x)) * (1 / torch.tensor(s_w))) + reference.bias
    )
    assert all(np.array_equal(value, trained[path]) for path, value in _fp8_state(model).items())


SHARDS, MICROBATCHES = 8, 2


def _microbatch_rows(rows: int) -> list[list[int]]:
    """Under SMP each data-parallel shard splits its own rows: microbatch m takes the m-th run of every shard."""
    run = rows // SHARDS // MICROBATCHES
    return [[s * rows // SHARDS + m * run + i for s in range(SHARDS) for i in range(run)] for m in range(MICROBATCHES)]


def test_data_parallel_fp8_microbatches_reduce_gradients_after_the_loop_as_te_scales_the_whole_batch():
    """dp8 x 2 microbatches: each replica multiplies its rows with its own copy of the weight (no weight-gradient
    all-reduce in the microbatch loop), while every scale is the whole microbatch's, as the torch emulation has it:
    a gradient amax summed over the replicas rather than their maximum would put the gradient scale off by up to 8x.
    """
    smp.init({"fp8": True, "fp8_amax_history_len": HISTORY, "microbatches": MICROBATCHES, "ddp": True})
    linear = nn.Linear(32, 16)
    reference = TorchDelayedScaling(linear.weight.detach().clone(), linear.bias.detach().clone())
    model = smp.DistributedModel(linear)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    generator = torch.Generator().manual_seed(5)
    # the replicas' rows differ in magnitude, so that each replica's own amax differs from the batch's
    magnitudes = torch.logspace(-1, 1, 32).reshape(32, 1)
    x, grad_out = torch.randn(32, 32, generator=generator) * magnitudes, torch.randn(32, 16, generator=generator)
    hlo = linear_step.lower(model, x, grad_out * 1e-3).compile().as_text()
    weight_bytes = linear.weight.numel() * 4
    assert all_reduce_bytes(hlo, SHARDS, SHARDS)["in_loop"] < weight_bytes / 8  # the scales' amaxes only
    for factor in (1.0, 8.0, 0.25):
        optimizer.zero_grad()
        linear_step(model, x * factor, grad_out * factor * 1e-3)
        grads = {name: torch.from_numpy(np.array(g)) for name, g in model.layout.by_name(model.grads).items()}
        optimizer.step()
        expected = [reference.step(x[rows] * factor, grad_out[rows] * factor * 1e-3) for rows in _microbatch_rows(32)]
        weight_grad = sum(e[1] for e in expected) / MICROBATCHES
        torch.testing.assert_close(grads["weight"], weight_grad, rtol=1e-6, atol=1e-6 * float(weight_grad.abs().max()))
        torch.testing.assert_close(grads["bias"], sum(e[2] for e in expected) / MICROBATCHES, rtol=1e-6, atol=1e-9)
        state = _fp8_state(model)
        for name, scaling in (("input", reference.input), ("grad", reference.grad)):
            np.testing.assert_allclose(state[f"fp8/{name}_amax_history"], scaling.history, rtol=1e-7)
            np.testing.assert_allclose(state[f"fp8/{name}_scale"], scaling.scale, rtol=1e-7)


class Format(enum.Enum):  # TE's recipe format, as a script passes it
    HYBRID = "HYBRID"


def test_a_loop_inside_te_fp8_autocast_trains_its_model_in_fp8_from_then_on():
    """A script written for TE (SMP v2's train.py --fp8 1): the model built without fp8, each forward run inside
    ``fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...))``, then ``loss.backward()`` and a torch optimizer."""
    smp.init({})
    linear = nn.Linear(32, 16)
    reference = TorchDelayedScaling(linear.weight.detach().clone(), linear.bias.detach().clone())
    model = smp.DistributedModel(linear)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    recipe = types.SimpleNamespace(
        fp8_format=Format.HYBRID, amax_history_len=HISTORY, amax_compute_algo="max", margin=0
    )
    generator = torch.Generator().manual_seed(3)
    for factor in (1.0, 8.0, 0.25):
        x = torch.randn(8, 32, generator=generator) * factor
        grad_out = torch.randn(8, 16, generator=generator) * factor * 1e-3
        with fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None):
            out = model(x)
        loss = (out * grad_out).sum()
        loss.backward()
        _, weight_grad, bias_grad, _ = reference.step(x, grad_out)
        torch.testing.assert_close(linear.weight.grad, weight_grad, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(linear.bias.grad, bias_grad, rtol=1e-6, atol=1e-9)
        optimizer.step()
        optimizer.zero_grad()
    state = _fp8_state(model)
    np.testing.assert_allclose(state["fp8/grad_amax_history"], reference.grad.history, rtol=1e-7)
    np.testing.assert_allclose(state["fp8/input_scale"], reference.input.scale, rtol=1e-7)
    assert model.fp8_recipe == DelayedScaling(amax_history_len=HISTORY)


def test_the_fp8_matmul_input_gradient_and_gradient_amax_match_the_emulation():
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, 5, 32, generator=generator), torch.randn(16, 32, generator=generator) * 0.1
    grad_out = torch.randn(2, 5, 16, generator=generator) * 1e-2
    scales = (jnp.float32(60.0), jnp.float32(900.0), jnp.float32(3e6))  # the last saturates some gradients

    @jax.jit
    def forward_and_back(*args):
        out, vjp = jax.vjp(lambda *a: scaled_matmul(*a, jnp.float8_e4m3fn, jnp.float8_e5m2), *args)
        return out, vjp(jnp.asarray(grad_out))

    out, grads = forward_and_back(jnp.asarray(x), jnp.asarray(weight), *scales)
    x_grad, weight_grad, x_scale_grad, weight_scale_grad, grad_amax = (np.array(g) for g in grads)
    out = np.array(out)

    s_x, s_w, s_g = (float(s) for s in scales)
    q_x, q_w = quantised(x.reshape(-1, 32), s_x, E4M3), quantised(weight, s_w, E4M3)
    q_g = quantised(grad_out.reshape(-1, 16), s_g, E5M2)
    inv = lambda s: 1 / torch.tensor(s)  # noqa: E731
    torch.testing.assert_close(torch.from_numpy(out), ((q_x @ q_w.T) * (inv(s_x) * inv(s_w))).reshape(2, 5, 16))
    torch.testing.assert_close(torch.from_numpy(x_grad), ((q_g @ q_w) * (inv(s_g) * inv(s_w))).reshape(2, 5, 32))
    torch.testing.assert_close(torch.from_numpy(weight_grad), (q_g.T @ q_x) * (inv(s_g) * inv(s_x)))
    assert float(x_scale_grad) == float(weight_scale_grad) == 0.0
    assert float(grad_amax) == float(grad_out.abs().max())  # the cotangent of grad_scale: what the step records
    assert float(grad_out.abs().max()) * s_g > torch.finfo(E5M2).max  # saturation was exercised


def test_fp8_products_on_operands_dequantised_to_the_compute_dtype_agree_to_its_rounding(monkeypatch):
    """``OPERAND_DTYPE = None`` (what benchmarks.gpu_speed's "bf16ops" side measures): bf16 operands and products
    for bf16 inputs, the float32 products' values to bf16's rounding."""
    generator = torch.Generator().manual_seed(5)
    x = jnp.asarray(torch.randn(8, 32, generator=generator)).astype(jnp.bfloat16)
    weight = jnp.asarray(torch.randn(16, 32, generator=generator) * 0.1).astype(jnp.bfloat16)
    scales = (jnp.float32(60.0), jnp.float32(900.0), jnp.float32(3e3))

    def forward_and_back(*args):
        out, vjp = jax.vjp(lambda *a: scaled_matmul(*a, jnp.float8_e4m3fn, jnp.float8_e5m2), *args)
        return out, vjp(jnp.ones_like(out))[:2]

    exact = forward_and_back(x, weight, *scales)
    monkeypatch.setattr(fp8_matmul, "OPERAND_DTYPE", None)
    dots = [e for e in jax.make_jaxpr(forward_and_back)(x, weight, *scales).eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    for ours, reference in zip(jax.tree.leaves(forward_and_back(x, weight, *scales)), jax.tree.leaves(exact)):
        np.testing.assert_allclose(np.float32(ours), np.float32(reference), rtol=2e-2, atol=2e-2)


def test_per_process_entries_record_the_largest_input_amax_and_at_least_the_largest_gradient_amax():
    """Under ``jax.vmap`` over processes (``process_shares``) with unbatched scaling state."""
    smp.init({"fp8": True, "fp8_amax_history_len": HISTORY})
    meta = fp8_state.Fp8Meta(DelayedScaling(amax_history_len=HISTORY))
    graphdef, state = nnx.split(meta)
    x = jnp.stack([jnp.full((4, 8), 0.5), jnp.full((4, 8), -3.0)])  # one block of rows per process
    grad_out = jnp.stack([jnp.full((4, 3), 0.25), jnp.full((4, 3), -2.0)])

    def loss(grad_scales, others):
        def one_process(x, g):
            meta = nnx.merge(graphdef, nnx.merge_state(others, grad_scales), copy=True)
            out = fp8_linear(meta, x, jnp.ones((3, 8)) * 0.5, None, across="processes")
            return (out * g).sum(), meta.input_amax_history[...]

        losses, histories = jax.vmap(one_process, axis_name="processes")(x, grad_out)
        return losses.sum(), histories

    amaxes, histories = jax.jit(jax.grad(loss, has_aux=True))(*fp8_state.split_gradient_scales(state))
    grad_amax = amaxes["grad_scale"][...]
    assert histories[:, 0].tolist() == [3.0, 3.0]  # each process records the largest input amax
    assert float(grad_amax) == 2.25  # the sum of the processes' amaxes (0.25 + 2): not below the largest


def _fp8_operand_formats(text: str) -> list[tuple[str, str]]:
    """For each ``dot_general`` in the StableHLO ``text``, the fp8 formats its operands were dequantised from: an
    operand ``convert(fp8 array) * scale`` gives the fp8 type, any other "none"."""
    lines = {m[1]: m[2] for m in re.finditer(r"(%\w+) = (stablehlo\.\w+ .*)", text)}

    def fp8_source(name: str) -> str:
        line = lines.get(name, "")
        if line.startswith("stablehlo.multiply"):
            for operand in re.findall(r"%\w+", line.split(":")[0]):
                found = re.match(r"stablehlo\.convert %\w+ : \(tensor<[\dx]*(f8\w+)>\)", lines.get(operand, ""))
                if found:
                    return found[1]
        return "none"

    dots = [line for line in lines.values() if line.startswith("stablehlo.dot_general")]
    return [tuple(fp8_source(name) for name in re.findall(r"%\w+", dot)[:2]) for dot in dots]


def test_the_step_program_multiplies_fp8_values_as_a_gpu_fuses_them_into_fp8_gemms():
    """Each product's operands are ``convert(fp8) * scale``: the pattern XLA's GPU compiler turns into one cuBLASLt
    fp8 GEMM (E4M3 x E4M3 forward, E5M2 x E4M3 backward)."""
    smp.init({"fp8": True, "fp8_amax_history_len": HISTORY})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 16)))
    text = linear_step.lower(model, torch.randn(8, 32), torch.randn(8, 16)).as_text()
    formats = sorted(_fp8_operand_formats(text))
    # two forward, two weight-gradient, one input-gradient (the second Linear's)
    assert formats == [("f8E4M3FN", "f8E4M3FN")] * 2 + [("f8E5M2", "f8E4M3FN")] * 3


def test_on_a_gpu_an_fp8_step_compiles_with_xla_triton_gemms_off_an_option_xla_knows():
    """With Triton's GEMM fusion on, XLA:GPU never rewrites the fp8 pattern into fp8 GEMMs (``jmp.remat.xla``)."""
    assert remat_xla.compiler_options("gpu", fp8=True) == {"xla_gpu_enable_triton_gemm": False}
    assert remat_xla.compiler_options("gpu") is None  # bf16 steps keep XLA's defaults
    options = remat_xla.compiler_options("gpu", fp8=True)
    compiled = jax.jit(lambda x: x @ x, compiler_options=options).lower(jnp.ones((4, 4))).compile()
    assert float(compiled(jnp.ones((4, 4)))[0, 0]) == 4.0  # XLA refuses an option it does not know by name


def test_fp8_refuses_a_pipeline_and_unknown_formats():
    with pytest.raises(ConfigError, match="pipeline"):
        smp.init({"fp8": True, "pipeline_parallel_degree": 2})
    with pytest.raises(ConfigError, match="fp8_format"):
        smp.init({"fp8": True, "fp8_format": "e5m2"})


LM_STEPS, SAVE_AT = 20, 10
BATCHES = markov_batches(LM_STEPS)
LM_TOLERANCE = 0.02  # relative, per step (see the module docstring)
VOCAB = SPEC["vocab_size"]  # the benchmark's Markov-chain token stream (256 tokens, 4 likely successors each)


class TinyLM(nn.Module):
    """A next-token model of 4 Linears (the Llama-sized runs are benchmarks/fp8.py's): each token's embedding with
    its predecessor's, mixed, a residual MLP block, the vocabulary head."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        tokens = self.embed(ids)
        previous = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)
        hidden = self.mix(torch.cat([tokens, previous], dim=-1))
        hidden = hidden + self.down(F.gelu(self.up(self.norm(hidden))))
        return self.head(hidden)


@smp.step
def next_token_step(model, ids):
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    model.backward(loss)
    return loss


class LMRun:
    """The tiny LM trained with AdamW on a new batch of the Markov-chain stream each step."""

    def __init__(self, config: dict):
        smp.init(config)
        torch.manual_seed(0)
        self.model = smp.DistributedModel(TinyLM())
        self.optimizer = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=3e-3))
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            self.optimizer.zero_grad()
            losses.append(float(next_token_step(self.model, BATCHES[self.step]).reduce_mean()))
            self.optimizer.step()
            self.step += 1
        return losses


def test_a_tiny_lm_trains_in_fp8_as_in_float32_and_resumes_bitwise(tmp_path):
    reference = LMRun({}).train(LM_STEPS)

    fp8 = LMRun({"fp8": True})
    losses = fp8.train(SAVE_AT)
    smp.save_checkpoint(tmp_path, "fp8", model=fp8.model, optimizer=fp8.optimizer, user_content={"step": fp8.step})
    saved_state = _fp8_state(fp8.model)
    losses += fp8.train(LM_STEPS - SAVE_AT)
    final_state = _fp8_state(fp8.model)
    assert any(not np.array_equal(final_state[path], saved_state[path]) for path in saved_state)

    for got, expected in zip(losses, reference, strict=True):
        assert abs(got - expected) <= LM_TOLERANCE * expected
    assert losses != reference  # the matmuls did run in fp8
    assert losses[-1] < 0.8 * losses[0]
    scales = {path: value for path, value in final_state.items() if path.endswith("_scale")}
    assert len(scales) == 3 * 4 and all(value != 1.0 for value in scales.values())  # every Linear's scales moved

    fp8.step = smp.resume_from_checkpoint(tmp_path, "fp8")["step"]  # into the same model: back to step 10
    assert _fp8_state(fp8.model).keys() == saved_state.keys()
    for path, value in _fp8_state(fp8.model).items():
        np.testing.assert_array_equal(value, saved_state[path], err_msg=path)
    assert fp8.train(LM_STEPS - SAVE_AT) == losses[SAVE_AT:]  # bit for bit, scaling state included
    for path, value in _fp8_state(fp8.model).items():
        np.testing.assert_array_equal(value, final_state[path], err_msg=path)
