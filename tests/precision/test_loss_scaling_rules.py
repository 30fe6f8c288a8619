"""Loss-scale arithmetic: SMP's dynamic loss scaler, torch's GradScaler rule, finiteness checks and unscaling."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jmp.errors import OptimizerError
from jmp.precision.loss_scaling import (
    DynamicLossScaleArgs,
    LossScaleState,
    all_finite,
    grad_scaler_updated,
    initial_state,
    unscaled,
    updated,
)

T, F = True, False


def _torch_grad_scaler_scales(pattern, init_scale, growth_interval, growth_factor=2.0, backoff_factor=0.5):
    """``get_scale()`` after each step of a real ``torch.amp.GradScaler``; ``inf`` is put in a grad on True steps."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    x = torch.randn(4, 3)
    scales = []
    for overflow in pattern:
        opt.zero_grad()
        loss = model(x).mean() * 1e-3  # small grads: only the injected inf overflows, even at scale 2**127
        scaler.scale(loss).backward()
        if overflow:
            model.weight.grad[0, 1] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return np.asarray(scales, np.float32)


@functools.partial(jax.jit, static_argnames=("growth_factor", "backoff_factor", "growth_interval"))
def _grad_scaler_scales(pattern, init_scale, growth_factor, backoff_factor, growth_interval):
    def step(carry, found_inf):
        carry = grad_scaler_updated(*carry, found_inf, growth_factor, backoff_factor, growth_interval)
        return carry, carry[0]

    _, scales = jax.lax.scan(step, (jnp.float32(init_scale), jnp.int32(0)), pattern)
    return scales


@functools.partial(jax.jit, static_argnames="args")
def _scan_updated(pattern: jax.Array, args: DynamicLossScaleArgs) -> LossScaleState:
    """The scaler's state after each step of ``pattern`` (True: overflow), stacked; overflow flags are traced."""

    def step(state, overflow):
        state = updated(state, overflow, args)
        return state, state

    _, states = jax.lax.scan(step, initial_state(args), pattern)
    return states


def _updated_scales(pattern, **args) -> np.ndarray:
    return np.asarray(_scan_updated(jnp.asarray(pattern), DynamicLossScaleArgs(**args)).scale)


# --- torch.amp.GradScaler's rule ---


@pytest.mark.parametrize(
    "init_scale, growth_interval, pattern",
    [
        (2.0**16, 3, [F, F, F, F, T, F, F, F, F, T, T, F, F, F, F, F, F, T, F]),
        (2.0**125, 1, [F, F, F, F, T, F, F]),  # growth past float32's max is skipped, not inf
    ],
)
def test_grad_scaler_updated_reproduces_torch_grad_scaler(init_scale, growth_interval, pattern):
    expected = _torch_grad_scaler_scales(pattern, init_scale, growth_interval)
    got = _grad_scaler_scales(jnp.asarray(pattern), init_scale, 2.0, 0.5, growth_interval)
    chex.assert_trees_all_equal(np.asarray(got), expected)


def test_grad_scaler_updated_takes_torchs_float_found_inf_flag_and_resets_tracker():
    scale, tracker = jax.jit(grad_scaler_updated, static_argnums=(3, 4, 5))(
        jnp.float32(8.0), jnp.int32(2), jnp.float32(1.0), 2.0, 0.5, 5
    )
    chex.assert_trees_all_equal((scale, tracker), (jnp.float32(4.0), jnp.int32(0)))
    scale, tracker = grad_scaler_updated(jnp.float32(8.0), jnp.int32(4), jnp.float32(0.0), 2.0, 0.5, 5)
    chex.assert_trees_all_equal((scale, tracker), (jnp.float32(16.0), jnp.int32(0)))


# --- SMP's dynamic loss scaler, against sequences worked out by hand from the reference algorithm ---


def test_updated_grows_every_window_and_halves_on_overflow():
    # window 3 counted from the last overflow (initially -1): growth after steps 2, 7, 12.
    pattern = [F, F, F, F, T, F, F, F, T, T, F, F, F]
    expected = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 1024, 512, 512, 512, 1024]
    got = _updated_scales(pattern, init_scale=1024, scale_window=3)
    chex.assert_trees_all_equal(got, np.asarray(expected, np.float32))


def test_updated_final_state_counts_iterations_and_last_overflow():
    states = _scan_updated(jnp.asarray([F, T, F, F]), DynamicLossScaleArgs(init_scale=16, scale_window=2))
    last = jax.tree.map(lambda x: x[-1], states)
    chex.assert_trees_all_equal(
        last, LossScaleState(jnp.float32(16.0), jnp.int32(4), jnp.int32(1), jnp.int32(1)), strict=True
    )


PATTERN = [T, F, T, F, F, F, T, T, T]


def test_updated_hysteresis_is_restored_only_on_growth_without_consecutive_hysteresis():
    # delayed_shift=2: the first overflow only spends hysteresis; it comes back only when the scale grows (step 5).
    states = _scan_updated(jnp.asarray(PATTERN), DynamicLossScaleArgs(init_scale=1024, scale_window=3, delayed_shift=2))
    chex.assert_trees_all_equal(
        np.asarray(states.scale), np.asarray([1024, 1024, 512, 512, 512, 1024, 1024, 512, 256], np.float32)
    )
    chex.assert_trees_all_equal(np.asarray(states.hysteresis), np.asarray([1, 1, 1, 1, 1, 2, 1, 1, 1], np.int32))


def test_updated_hysteresis_is_restored_on_every_clean_step_with_consecutive_hysteresis():
    # Only two overflows in a row cut the scale: steps 0 and 2 are isolated, so the cuts come at steps 7 and 8.
    args = DynamicLossScaleArgs(init_scale=1024, scale_window=3, delayed_shift=2, consecutive_hysteresis=True)
    states = _scan_updated(jnp.asarray(PATTERN), args)
    chex.assert_trees_all_equal(
        np.asarray(states.scale), np.asarray([1024, 1024, 1024, 1024, 1024, 2048, 2048, 1024, 512], np.float32)
    )
    chex.assert_trees_all_equal(np.asarray(states.hysteresis), np.asarray([1, 2, 1, 2, 2, 2, 1, 1, 1], np.int32))


def test_updated_clamps_the_scale_at_min_scale():
    pattern = [T, T, T, F, F, T]
    expected = [4, 3, 3, 3, 6, 3]  # 8 -> 4 -> max(2, 3) -> max(1.5, 3); growth after 2 clean steps
    got = _updated_scales(pattern, init_scale=8, scale_window=2, min_scale=3)
    chex.assert_trees_all_equal(got, np.asarray(expected, np.float32))


def test_updated_does_not_grow_past_float32_max():
    args = DynamicLossScaleArgs(init_scale=2.0**126, scale_window=1)
    state = initial_state(args)
    for _ in range(3):  # eagerly, with a Python bool
        state = updated(state, False, args)
    chex.assert_trees_all_equal(state.scale, jnp.float32(2.0**127))


@pytest.mark.parametrize("window, factor", [(1, 2.0), (3, 2.0), (4, 4.0)])
def test_updated_without_hysteresis_equals_torch_grad_scaler(window, factor):
    """With delayed_shift=1 and scale_window=N, SMP's scaler is torch's GradScaler with growth_interval=N,
    growth_factor=scale_factor and backoff_factor=1/scale_factor (while min_scale does not bind): both grow after
    N clean steps counted from the last overflow or growth, and cut on every overflow."""
    pattern = list(np.random.default_rng(window).random(24) < 0.3)
    expected = _torch_grad_scaler_scales(pattern, 2.0**16, window, growth_factor=factor, backoff_factor=1 / factor)
    got = _updated_scales(pattern, init_scale=2.0**16, scale_factor=factor, scale_window=window, min_scale=2.0**-60)
    chex.assert_trees_all_equal(got, expected)


# --- DynamicLossScaleArgs ---


def test_from_dict_defaults_are_smps():
    args = DynamicLossScaleArgs.from_dict(None)
    assert args == DynamicLossScaleArgs.from_dict({})
    assert (args.init_scale, args.scale_factor, args.scale_window, args.min_scale) == (2.0**32, 2.0, 1000, 1.0)
    assert (args.delayed_shift, args.consecutive_hysteresis) == (1, False)
    assert DynamicLossScaleArgs.from_dict({"scale_window": 10, "delayed_shift": 2}).scale_window == 10


@pytest.mark.parametrize(
    "d, match",
    [
        ({"scale_windw": 10}, r"unknown key.*scale_windw.*valid keys.*scale_window"),
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale.*float32"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"scale_factor": 1.0}, "scale_factor.*greater than 1"),
        ({"scale_window": 0}, r"scale_window.*integer >= 1"),
        ({"scale_window": 2.5}, "scale_window"),
        ({"delayed_shift": 0}, "delayed_shift"),
        ({"delayed_shift": True}, "delayed_shift"),
        ({"consecutive_hysteresis": "yes"}, "consecutive_hysteresis.*True or False"),
        ({"init_scale": "65536"}, "init_scale"),
    ],
)
def test_from_dict_rejects_bad_keys_and_values(d, match):
    with pytest.raises(OptimizerError, match=match):
        DynamicLossScaleArgs.from_dict(d)


def test_from_dict_rejects_a_non_dict():
    with pytest.raises(OptimizerError, match="must be a dict"):
        DynamicLossScaleArgs.from_dict([("init_scale", 2.0)])


# --- all_finite and unscaled ---


def _tree():
    return {
        "w": jnp.ones((3, 2), jnp.float32),
        "b": (jnp.full((4,), 1e38, jnp.bfloat16), jnp.full((2,), 65504.0, jnp.float16)),  # finite in their own dtype
        "step": jnp.arange(3, dtype=jnp.int32),
    }


@pytest.mark.parametrize(
    "path, value, finite",
    [
        (None, None, True),
        (("w",), float("nan"), False),
        (("b", 0), float("inf"), False),
        (("b", 1), -float("inf"), False),
        (("b", 1), float("nan"), False),
    ],
)
def test_all_finite(path, value, finite):
    tree = _tree()
    if path is not None:
        key, *rest = path
        if rest:
            leaves = list(tree[key])
            leaves[rest[0]] = leaves[rest[0]].at[0].set(value)
            tree[key] = tuple(leaves)
        else:
            tree[key] = tree[key].at[1, 1].set(value)
    result = jax.jit(all_finite)(tree)
    chex.assert_shape(result, ())
    chex.assert_type(result, bool)
    assert bool(result) is finite


def test_all_finite_ignores_non_floating_leaves_and_is_true_for_an_empty_tree():
    assert bool(all_finite({"step": jnp.int32(2**31 - 1), "mask": jnp.array([True, False])}))
    assert bool(all_finite({}))


def test_unscaled_casts_floating_leaves_to_float32_and_multiplies():
    tree = _tree()
    got = jax.jit(unscaled)(tree, jnp.float32(2.0**-16))
    chex.assert_trees_all_equal(got["step"], tree["step"], strict=True)
    for original, result in [(tree["w"], got["w"]), *zip(tree["b"], got["b"])]:
        chex.assert_type(result, jnp.float32)
        chex.assert_trees_all_close(result, np.asarray(original, np.float32) * 2.0**-16, rtol=0, atol=0)
    chex.assert_trees_all_equal(got["b"][1], jnp.full((2,), 65504.0 / 65536.0, jnp.float32))
