"""XLA:CPU deadlocks when a few dozen collective programs are queued (whatever order their meshes give the
devices); jmp keeps at most two training steps queued on CPU meshes, so a loop that reads nothing runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch

import jmp as smp
from jmp.runtime import programs_in_flight

ROOT = Path(__file__).resolve().parents[2]


class _Result:
    """Stands for a dispatched program's array: records when it is waited for."""

    def __init__(self, name: str, waited: list[str], deleted: bool = False):
        self.name, self.waited, self.deleted = name, waited, deleted

    def is_deleted(self) -> bool:
        return self.deleted

    def block_until_ready(self) -> _Result:
        self.waited.append(self.name)
        return self


@pytest.fixture
def restore_bound():
    before = programs_in_flight.limit()
    yield
    programs_in_flight.bound(before)


def test_the_oldest_of_more_than_limit_results_is_waited_for_and_a_donated_one_gives_way(restore_bound):
    waited: list[str] = []
    programs_in_flight.bound(2)
    for name in ("step0", "step1"):
        programs_in_flight.admit(_Result(name, waited))
    assert waited == [] and programs_in_flight.kept() == 2
    programs_in_flight.admit(_Result("step2", waited))
    assert waited == ["step0"] and programs_in_flight.kept() == 2
    programs_in_flight.admit(_Result("step3", waited, deleted=True))
    programs_in_flight.admit(_Result("step4", waited))
    # step1 waited for when step3 came; at step4, step2 is the oldest; step3 (donated since) is skipped later
    assert waited == ["step0", "step1", "step2"]
    programs_in_flight.admit(_Result("step5", waited))
    assert waited == ["step0", "step1", "step2", "step4"] and programs_in_flight.kept() == 1
    programs_in_flight.bound(0)
    programs_in_flight.admit(_Result("unbounded", waited))
    assert programs_in_flight.kept() == 0 and waited[-1] == "step4"
    with pytest.raises(ValueError, match="0 \\(no bound\\) or more, got -1"):
        programs_in_flight.bound(-1)


def test_queued_collective_programs_over_differently_ordered_meshes_complete_under_the_bound():
    """120 all-reduces over the 8 devices, in order and reversed, dispatched alternately: unbounded, XLA:CPU
    deadlocks before the end (benchmarks/programs_in_flight.py); bounded, they complete."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "tests/multiprocess/queued_programs_script.py", "bounded", "60"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["programs"] == 120 and report["kept"] == 2


def test_smp_init_bounds_a_cpu_mesh_and_each_optimizer_step_keeps_one_gradient(restore_bound):
    smp.init({}, devices=jax.devices()[:1])
    assert programs_in_flight.limit() == 0  # one device: no collectives
    smp.init({})
    assert programs_in_flight.limit() == programs_in_flight.STEPS_AHEAD_ON_CPU == 2
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    x = torch.randn(8, 4)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(step(model, x))
        optimizer.step()
        assert programs_in_flight.kept() <= 2
    assert programs_in_flight.kept() == 2
    assert float(losses[2].reduce_mean()) < float(losses[0].reduce_mean())  # the steps trained


def test_jmp_cpu_steps_in_flight_sets_the_bound_of_cpu_meshes():
    assert programs_in_flight.cpu_limit({}) == programs_in_flight.STEPS_AHEAD_ON_CPU
    assert programs_in_flight.cpu_limit({"JMP_CPU_STEPS_IN_FLIGHT": "0"}) == 0
    assert programs_in_flight.cpu_limit({"JMP_CPU_STEPS_IN_FLIGHT": "5"}) == 5
    with pytest.raises(ValueError, match="JMP_CPU_STEPS_IN_FLIGHT='two': give the number of training steps"):
        programs_in_flight.cpu_limit({"JMP_CPU_STEPS_IN_FLIGHT": "two"})


def test_forward_only_steps_keep_one_output_each(restore_bound):
    # an evaluation loop reads nothing and steps no optimizer: its programs are bounded by their outputs
    smp.init({})
    model = smp.DistributedModel(torch.nn.Linear(4, 2))

    @smp.step
    def evaluate(model, x):
        return model(x).square().mean()

    x = torch.randn(8, 4)
    for _ in range(3):
        evaluate(model, x)
        assert programs_in_flight.kept() <= 2
    assert programs_in_flight.kept() == 2
