"""Convolutions emitted in XLA:CPU's canonical layout: same values and gradients, fast path inside loops."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax import lax
from torch import nn

import jmp
from jmp.torch_bridge.lowering.cpu_convolution import conv_general_dilated

CASES = {
    "2d strided dilated": dict(
        x=(3, 4, 11, 13), w=(6, 4, 3, 2), strides=(2, 1), padding=[(1, 0), (2, 1)], rhs_dilation=(1, 2), groups=1
    ),
    "2d grouped": dict(x=(2, 6, 9, 9), w=(6, 2, 3, 3), strides=(1, 1), padding=[(1, 1), (1, 1)], groups=3),
    "1d": dict(x=(2, 3, 10), w=(5, 3, 4), strides=(3,), padding=[(0, 2)], rhs_dilation=(2,), groups=1),
    "3d": dict(x=(2, 2, 5, 6, 7), w=(4, 2, 2, 3, 2), strides=(1, 2, 1), padding=[(0, 0), (1, 1), (0, 1)], groups=1),
    "2d transposed": dict(
        x=(2, 3, 6, 5), w=(4, 3, 3, 3), strides=(1, 1), padding=[(2, 2), (2, 3)], lhs_dilation=(2, 2)
    ),
}
LAYOUTS = {3: ("NCH", "OIH", "NCH"), 4: ("NCHW", "OIHW", "NCHW"), 5: ("NCDHW", "OIDHW", "NCDHW")}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_values_and_gradients_equal_lax(case):
    c = dict(CASES[case])
    x = jax.random.normal(jax.random.key(0), c.pop("x"))
    w = jax.random.normal(jax.random.key(1), c.pop("w"))
    kwargs = dict(
        window_strides=c.pop("strides"),
        padding=c.pop("padding"),
        feature_group_count=c.pop("groups", 1),
        dimension_numbers=LAYOUTS[x.ndim],
        **c,
    )

    def loss(conv, x, w):
        return jnp.sum(jnp.sin(conv(x, w, **kwargs)))

    np.testing.assert_allclose(
        conv_general_dilated(x, w, **kwargs), lax.conv_general_dilated(x, w, **kwargs), rtol=1e-5, atol=1e-5
    )
    ours = jax.grad(loss, (1, 2))(conv_general_dilated, x, w)
    reference = jax.grad(loss, (1, 2))(lax.conv_general_dilated, x, w)
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_converted_convolutions_stay_canonical_inside_a_scan():
    """XLA:CPU canonicalises convolution layouts in the entry computation only; a scan body is not one.

    Every convolution of the gradient of a converted torch conv net, accumulated over microbatches in a
    ``lax.scan``, must reach the compiler as batch-spatial-feature / spatial-in-out (Eigen's form).
    """
    net = jmp.torch_bridge.convert(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3, stride=2)))
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) ** 2)

    def accumulated(params, xs):
        def body(total, x):
            return jax.tree.map(jnp.add, total, jax.grad(loss)(params, x)), None

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)[0]

    xs = jnp.asarray(torch.randn(3, 2, 1, 12, 12).numpy())
    hlo = jax.jit(accumulated).lower(params, xs).compile().as_text()
    labels = re.findall(r"convolution\(.*dim_labels=(\S+?),", hlo)
    assert len(labels) == 5, hlo  # two forward, two filter gradients, one input gradient
    assert set(labels) == {"b01f_01io->b01f"}, labels


def test_pieces_inside_a_pipeline_stage_take_rows_of_every_device_and_move_none(monkeypatch):
    """Inside the pipeline's ``shard_map`` (pp manual, the batch split over dp by XLA), a convolution cut into
    cache-sized pieces must cut each device's rows, not the whole batch: a piece of the whole batch lies on
    some devices only, and XLA moved it with collective permutes that wait for every stage's devices while
    only one stage runs its code (issue 31, item 15: the main job stopped with a PipelineError at a per-process
    batch of 64 on 8 processes). Values and gradients stay lax's."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jmp.torch_bridge.lowering import cpu_convolution

    monkeypatch.setattr(cpu_convolution, "PIECE_BYTES", 16 * 1024)  # cut this small convolution into pieces
    mesh = jax.make_mesh((2, 4), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    kwargs = dict(window_strides=(1, 1), padding=[(0, 0), (0, 0)], dimension_numbers=LAYOUTS[4])
    x = jax.random.normal(jax.random.key(0), (32, 4, 12, 12))
    w = jax.random.normal(jax.random.key(1), (8, 4, 3, 3))

    def stage(conv):
        def loss(x, w):
            return jnp.sum(jnp.sin(conv(x, w, **kwargs)))

        def per_stage(x, w):  # x's batch is split over dp by XLA's partitioner, as a stage's microbatch
            return (loss(x, w), *jax.grad(loss, (0, 1))(x, w))

        run = jax.shard_map(
            per_stage, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names={"pp"}
        )
        return jax.jit(run, in_shardings=(NamedSharding(mesh, PartitionSpec("dp")), None))

    ours = stage(conv_general_dilated)
    hlo = ours.lower(x, w).compile().as_text()
    assert len(re.findall(r"convolution\(", hlo)) > 3, "the convolutions were not cut into pieces"
    assert "collective-permute" not in hlo
    for a, b in zip(ours(x, w), stage(lax.conv_general_dilated)(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
