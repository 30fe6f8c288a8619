"""The pipeline's pure pieces on their own: schedules, carry slots, rest placement, balancing, stage layout.

Nothing here compiles a model; each test takes milliseconds to a fraction of a second.
"""

from __future__ import annotations

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.core import ShapedArray
from jax.sharding import Mesh, PartitionSpec
from torch import nn

import jmp as smp
from jmp.pipeline import placement, residuals, schedule
from jmp.pipeline.graph import Call
from jmp.pipeline.schedule import BACKWARD, FORWARD, IDLE
from jmp.pipeline.split import assign_slots
from jmp.pipeline.stage_buffers import StageLayout
from tests.pipeline.models import Dropping, NormNet, RunningCenter, Skips, rest_names, skips_layout, stage_programs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 3), (4, 8), (4, 16)]


# --- schedules -----------------------------------------------------------------------------------------------


def ticks_of(plan: schedule.Schedule, stage: int, action: int) -> dict[int, int]:
    """Microbatch -> the tick at which ``stage`` does ``action`` on it (each at most once)."""
    found: dict[int, int] = {}
    for tick in range(plan.ticks):
        if plan.action[tick, stage] == action:
            m = int(plan.microbatch[tick, stage])
            assert m not in found, f"stage {stage} does {action} on microbatch {m} twice"
            found[m] = tick
    return found


@pytest.mark.parametrize("kind", ["simple", "interleaved"])
@pytest.mark.parametrize(("pp", "microbatches"), SIZES)
def test_every_stage_runs_each_microbatch_forward_then_backward_once(kind, pp, microbatches):
    plan = schedule.build(kind, pp, microbatches)
    everyone = list(range(microbatches))
    forwards = [ticks_of(plan, s, FORWARD) for s in range(pp)]
    backwards = [ticks_of(plan, s, BACKWARD) for s in range(pp)]
    for s in range(pp):
        assert sorted(forwards[s], key=forwards[s].get) == everyone  # each once, in order
        assert sorted(backwards[s], key=backwards[s].get) == everyone
        assert all(forwards[s][m] < backwards[s][m] for m in everyone)
        if s + 1 < pp:
            assert all(backwards[s][m] > backwards[s + 1][m] for m in everyone)  # its cotangent comes from s + 1
        if s > 0:
            assert all(forwards[s][m] > forwards[s - 1][m] for m in everyone)  # its input comes from s - 1


@pytest.mark.parametrize("kind", ["simple", "interleaved"])
@pytest.mark.parametrize(("pp", "microbatches"), SIZES)
def test_messages_arrive_the_tick_after_they_are_sent(kind, pp, microbatches):
    plan = schedule.build(kind, pp, microbatches)
    for tick in range(plan.ticks):
        for s in range(pp):
            sent_on = plan.action[tick - 1, s - 1] == FORWARD if tick and s else False
            expected = plan.microbatch[tick - 1, s - 1] if sent_on else -1
            assert plan.received_forward[tick, s] == expected
            sent_back = plan.action[tick - 1, s + 1] == BACKWARD if tick and s + 1 < pp else False
            expected = plan.microbatch[tick - 1, s + 1] if sent_back else -1
            assert plan.received_backward[tick, s] == expected


@pytest.mark.parametrize("kind", ["simple", "interleaved"])
@pytest.mark.parametrize(("pp", "microbatches"), SIZES)
def test_microbatches_a_stage_holds_at_once_have_distinct_slots(kind, pp, microbatches):
    """From its input's arrival to its backward a microbatch sits in slot m % slots: never two at once."""
    plan = schedule.build(kind, pp, microbatches)
    for s in range(pp):
        finished = ticks_of(plan, s, BACKWARD)
        arrived = {m: 0 for m in range(microbatches)} if s == 0 else {}
        for tick in range(plan.ticks):
            if plan.received_forward[tick, s] >= 0:
                arrived[int(plan.received_forward[tick, s])] = tick
        for tick in range(plan.ticks):
            held = [m for m in range(microbatches) if m in arrived and arrived[m] <= tick <= finished[m]]
            if s == 0:  # stage 0 takes its inputs from the batch: held from its forward on
                started = ticks_of(plan, 0, FORWARD)
                held = [m for m in range(microbatches) if started[m] <= tick <= finished[m]]
            assert len({m % plan.slots for m in held}) == len(held), (s, tick, held)


@pytest.mark.parametrize(("pp", "microbatches"), SIZES)
def test_interleaved_keeps_a_bounded_number_of_microbatches_in_flight(pp, microbatches):
    """1F1B: stage s starts at most pp - s forwards ahead of its backwards, so a stage holds at most pp + 1
    microbatches (its next input may arrive while it holds pp), however many microbatches there are."""
    plan = schedule.build("interleaved", pp, microbatches)
    for s in range(pp):
        in_flight = np.cumsum(plan.action[:, s] == FORWARD) - np.cumsum(plan.action[:, s] == BACKWARD)
        assert in_flight.max() == min(pp - s, microbatches)
    assert plan.slots <= min(pp + 1, microbatches)
    simple = schedule.build("simple", pp, microbatches)
    assert simple.slots == microbatches  # every microbatch's input kept until its backward


@pytest.mark.parametrize("kind", ["simple", "interleaved"])
@pytest.mark.parametrize("active", [1, 2])
def test_active_microbatches_caps_what_a_stage_has_in_flight(kind, active):
    """SMP's active_microbatches: no stage starts a forward while that many await their backward; the
    schedule still runs every microbatch forward then backward, in order."""
    pp, microbatches = 3, 6
    plan = schedule.build(kind, pp, microbatches, active=active)
    for s in range(pp - 1):
        in_flight = np.cumsum(plan.action[:, s] == FORWARD) - np.cumsum(plan.action[:, s] == BACKWARD)
        assert in_flight.max() <= active
        assert sorted(ticks_of(plan, s, BACKWARD)) == list(range(microbatches))
    assert plan.slots <= active + 1  # a stage's next input may arrive while it holds `active` microbatches
    assert plan.ticks > schedule.build(kind, pp, microbatches).ticks  # fewer in flight: a longer pipeline


@pytest.mark.parametrize("kind", ["simple", "interleaved"])
@pytest.mark.parametrize(("pp", "microbatches"), SIZES)
def test_idle_fraction(kind, pp, microbatches):
    """Forwards and backwards take a tick each on every stage: the textbook 2 (M + pp - 1) ticks and idle
    fraction (pp - 1) / (M + pp - 1), interleaved or not."""
    plan = schedule.build(kind, pp, microbatches)
    assert np.sum(plan.action != IDLE) == 2 * microbatches * pp
    assert plan.ticks == 2 * (microbatches + pp - 1)
    assert plan.bubble == pytest.approx((pp - 1) / (microbatches + pp - 1))
    assert plan.ticks <= schedule.build("simple", pp, microbatches).ticks
    forward_only = schedule.build(kind, pp, microbatches, backward=False)
    assert forward_only.ticks == microbatches + pp - 1
    assert forward_only.bubble == pytest.approx((pp - 1) / (microbatches + pp - 1))  # GPipe's bubble


# --- residuals kept from forward to backward --------------------------------------------------------------


def _layer(weights, data):
    """A dense layer: ``x @ w.T`` (jax.vjp keeps the transposed weight, computed from the weight alone)."""
    (x,) = data
    return jax.vjp(lambda w, x: (jnp.tanh(x @ w.T).sum(), ()), weights["w"], x, has_aux=True)


def _head(weights, data):
    (x,) = data
    return jax.vjp(lambda w, x: (jnp.sin(x @ w.T).sum() + jnp.cos(x).sum(), ()), weights["w"], x, has_aux=True)


def test_residuals_store_activations_not_weights_or_inputs():
    weights, data = {"w": jnp.ones((16, 8))}, (jnp.ones((4, 8)),)
    plan = residuals.plan([residuals.trace_vjp(f, weights, data) for f in (_layer, _layer, _head)])
    # tanh's output and 1 - tanh for its derivative; sin's cos and cos's sin; the transposed weight [8, 16]
    # and the input x are derived again
    assert [[plan.pool[e].shape for _, e in stage] for stage in plan.stored] == [[(4, 16)] * 2] * 2 + [
        [(4, 16), (4, 8)]
    ]
    assert [e.shape for e in plan.pool] == [(4, 16), (4, 16), (4, 8)]  # equal stages share their pool entries
    assert plan.stored[0] == plan.stored[1]
    assert plan.stored[2][0][1] == plan.stored[0][0][1]


def test_a_traced_pullback_with_its_residuals_swapped_in_gives_the_gradient():
    weights, data = (
        {"w": jax.random.normal(jax.random.key(0), (16, 8))},
        (jax.random.normal(jax.random.key(1), (4, 8)),),
    )
    traced = residuals.trace_vjp(_head, weights, data)
    plan = residuals.plan([traced])
    kept = jax.jit(lambda w, d: plan.pack(0, traced.run_forward(w, d)[1]))(weights, data)

    @jax.jit
    def backward(w, d, entries):
        return traced.run_pullback(plan.unpack(0, traced.run_forward(w, d)[1], entries), jnp.ones(()))

    expected = jax.grad(lambda w, x: jnp.sin(x @ w.T).sum() + jnp.cos(x).sum(), argnums=(0, 1))(weights["w"], data[0])
    chex.assert_trees_all_close(backward(weights, data, kept), expected, rtol=1e-6)
    # the backward reads the stored entries, not a recomputation of them
    zeroed = backward(weights, data, tuple(jnp.zeros_like(e) for e in kept))
    assert not np.allclose(zeroed[1], expected[1])
    compiled = backward.lower(weights, data, kept).compile().as_text()
    assert " sine(" not in compiled and " cosine(" not in compiled  # XLA dropped the forward evaluated again


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'simple' or 'interleaved'"):
        schedule.build("zigzag", 2, 2)


# --- carry slots ---------------------------------------------------------------------------------------------


def test_slots_are_reused_only_by_values_whose_journeys_do_not_overlap():
    wide, narrow = ShapedArray((4, 16), jnp.float32), ShapedArray((4, 8), jnp.float32)
    whole = ShapedArray((4, 16), jnp.int32)
    travels = [(wide, 0, 2), (narrow, 0, 1), (wide, 1, 2), (wide, 2, 3), (narrow, 1, 3), (whole, 2, 3)]
    slot_of, slots = assign_slots(travels)
    # boundaries carried: [0, 2) [0, 1) [1, 2) [2, 3) [1, 3) [2, 3)
    assert slot_of == [0, 1, 2, 0, 1, 3]
    assert [(s.shape, s.dtype) for s in slots] == [
        ((4, 16), jnp.float32),
        ((4, 8), jnp.float32),
        ((4, 16), jnp.float32),
        ((4, 16), jnp.int32),
    ]


def test_a_random_key_crossing_stages_is_refused():
    key = jax.eval_shape(lambda: jax.random.key(0))
    with pytest.raises(smp.PipelineError, match="random key"):
        assign_slots([(ShapedArray(key.shape, key.dtype), 0, 1)])


def test_values_sharing_a_slot_in_a_traced_model_never_travel_together():
    programs = stage_programs(Skips(), 3, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    born = {v: s for s, eqns in enumerate(programs.eqns) for eqn in eqns for v in eqn.outvars}
    last = {v: max(s for s in range(programs.pp) if v in programs.received[s]) for v in programs.slot_of}
    values = list(programs.slot_of)
    for i, a in enumerate(values):
        for b in values[i + 1 :]:
            if programs.slot_of[a] == programs.slot_of[b]:
                assert last[a] <= born[b] or last[b] <= born[a]
    assert len(programs.slots) == 5  # h1 skips stage 1, so h5 cannot take its slot


def test_the_carry_layout_is_the_same_in_every_process():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    layouts = []
    for seed in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-m", "tests.pipeline.models"],
            cwd=ROOT,
            env=env | {"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        layouts.append(run.stdout.splitlines())
    assert layouts[0] == layouts[1] == skips_layout()
    assert len(layouts[0]) == 5 + 5  # five slots, five travelling values


# --- buffers and the random stream ---------------------------------------------------------------------------


def placement_of(net: nn.Module):
    programs = stage_programs(net, 2, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    names = rest_names(net)
    return programs, {names[i]: programs.owner[i] for i in programs.threaded}, [names[i] for i in programs.restarted]


@pytest.mark.parametrize("norm_stage", [0, 1])
def test_batch_norm_statistics_thread_on_the_stage_of_the_norm(norm_stage):
    programs, threaded, restarted = placement_of(NormNet(norm_stage))
    stats = ("norm.num_batches_tracked", "norm.running_mean", "norm.running_var")
    assert threaded == dict.fromkeys(stats, norm_stage) and restarted == []
    assert programs.held == []  # in train mode the statistics do not reach the output


def test_a_buffer_reaching_the_output_is_held_for_the_backward():
    programs, threaded, _ = placement_of(NormNet(0, RunningCenter))
    assert threaded == {"norm.mean": 0}
    assert programs.held == programs.threaded


def test_a_random_stream_drawn_on_two_stages_restarts_each_microbatch():
    programs, threaded, restarted = placement_of(Dropping())
    assert threaded == {} and [name.rsplit(".", 3)[1:] for name in restarted] == [["rngs", "default", "count"]]
    # (the key itself is not updated: draws fold the counter in)
    assert programs.readers[programs.restarted[0]] == (0,)
    assert programs.home[programs.restarted[0]] == 1


# --- automatic balancing -------------------------------------------------------------------------------------


def test_balanced_split_minimises_the_largest_run():
    assert placement._balanced([1, 2, 3, 4, 5], 3) == (6, [0, 3, 4])  # [1 2 3] [4] [5]
    assert placement._balanced([4, 1, 1, 2], 2) == (4, [0, 1])


class Mix(nn.Module):
    """No parameters, many flops: x @ x.T @ x."""

    def forward(self, x):
        return torch.tanh(x @ x.transpose(0, 1) @ x)


class Chain(nn.Module):
    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def automatic_starts(net: nn.Module, stages: int, memory_weight: float, rows: int = 64) -> dict[str, int]:
    programs = stage_programs(net, 1, jax.ShapeDtypeStruct((rows, 64), jnp.float32))
    jaxpr = programs.jaxpr
    params = jaxpr.jaxpr.invars[: len(programs.param_names)]
    sizes = {v: int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in params}
    constants = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
    partition = placement.automatic(jaxpr.jaxpr.eqns, sizes, constants, stages, memory_weight)
    return {call.path: stage for call, stage in partition.starts.items()}


def test_automatic_cut_balances_parameter_bytes():
    # parameters 4160, 1040, 272 and 1088: [4160] against [2400] is the most even cut
    net = Chain(nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(16, 16), nn.Linear(16, 64))
    assert automatic_starts(net, 2, memory_weight=1.0) == {"layers.1": 1}


def test_automatic_cut_balances_flops_or_bytes_as_weighted():
    # flops (64 rows): 0.5M, 0.5M, 1M (Mix) -> Mix alone; bytes: 4160, 4160, 0 -> a linear alone
    net = Chain(nn.Linear(64, 64), nn.Linear(64, 64), Mix())
    assert automatic_starts(net, 2, memory_weight=0.0) == {"layers.2": 1}
    assert automatic_starts(net, 2, memory_weight=1.0) == {"layers.1": 1}


def test_automatic_cut_goes_deeper_only_when_the_outer_calls_are_too_few():
    def block():
        return Chain(nn.Linear(64, 64), nn.Linear(64, 64))

    net = Chain(block(), block())
    assert automatic_starts(net, 2, memory_weight=1.0) == {"layers.1": 1}
    assert automatic_starts(net, 4, memory_weight=1.0) == {
        "layers.0.layers.1": 1,
        "layers.1.layers.0": 2,
        "layers.1.layers.1": 3,
    }


def test_partition_assigns_each_equation_the_furthest_stage_reached():
    programs = stage_programs(Skips(), 3, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    partition = placement.Partition(3, starts={Call("c", 0): 1, Call("h", 0): 2})
    stage_of = partition.assign(programs.jaxpr.jaxpr.eqns)
    assert stage_of == sorted(stage_of) and set(stage_of) == {0, 1, 2}


# --- stage layout ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage_layout():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("pp", "dp"))
    shapes = {"a.weight": (8, 4), "b.weight": (16, 6), "tied.weight": (5, 3), "b.bias": (6,)}
    dtypes = dict.fromkeys(shapes, jnp.float32) | {"b.bias": jnp.bfloat16}
    specs = dict.fromkeys(shapes, PartitionSpec()) | {"b.weight": PartitionSpec("dp")}
    stages = {"a.weight": (0,), "b.weight": (1,), "b.bias": (1,), "tied.weight": (0, 1)}
    layout = StageLayout(shapes, dtypes, specs, stages, dict.fromkeys(shapes, "all"), mesh)
    values = {n: jnp.arange(np.prod(s), dtype=dtypes[n]).reshape(s) + i * 10 for i, (n, s) in enumerate(shapes.items())}
    return layout, values


def test_pack_then_unpack_gives_the_parameters_back(stage_layout):
    layout, values = stage_layout
    packed = layout.pack(values)
    for key, buffer in packed.items():
        assert buffer.shape[0] == 2 and buffer.sharding.spec == layout.buffers[key].spec
    unpacked = layout.unpack(packed)
    assert set(unpacked) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(unpacked[name]), np.asarray(value))


def test_each_stage_row_holds_its_own_parameters_and_the_tied_one(stage_layout):
    layout, values = stage_layout
    packed = layout.pack(values)
    for stage in (0, 1):
        rows = {key: buffer[stage : stage + 1] for key, buffer in packed.items()}
        names = layout.stage_names(stage)
        assert "tied.weight" in names
        for name, value in layout.stage_params(rows, stage, names).items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(values[name]))
    assert layout.stage_names(0) == ["a.weight", "tied.weight"]
    assert layout.stage_names(1) == ["b.weight", "tied.weight", "b.bias"]


def test_tied_copies_get_the_sum_of_their_gradients(stage_layout):
    layout, values = stage_layout
    grads = layout.pack({n: jnp.ones_like(v) for n, v in values.items()})
    synced = layout.unpack(layout.sync_tied(grads, {}))
    np.testing.assert_array_equal(np.asarray(synced["tied.weight"]), 2.0)
    np.testing.assert_array_equal(np.asarray(synced["a.weight"]), 1.0)


def test_tied_copies_are_summed_in_the_dtype_the_forward_reads_them_in(stage_layout):
    """Two fp16 gradient copies of 40,000 each overflow fp16 when summed, as one fp16 gradient of the tied weight
    does in PyTorch (the step is then skipped); summed in float32 they would not."""
    layout, values = stage_layout
    grads = layout.pack({n: jnp.full_like(v, 40000.0) for n, v in values.items()})
    in_fp16 = layout.unpack(layout.sync_tied(grads, {"tied.weight": jnp.float16}))
    assert np.all(np.isinf(np.asarray(in_fp16["tied.weight"])))
    in_fp32 = layout.unpack(layout.sync_tied(grads, {}))
    np.testing.assert_array_equal(np.asarray(in_fp32["tied.weight"]), 80000.0)
