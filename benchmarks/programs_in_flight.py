"""XLA:CPU's deadlock on a long queue of collective programs, and jmp's bound on the steps queued (issue 36).

    python -m benchmarks.programs_in_flight [--out benchmarks/results/programs_in_flight.json]

Queued programs
    ``tests/multiprocess/queued_programs_script.py``: two all-reduce programs over 8 CPU devices (one process, or
    2 processes x 4 under ``jmp.launch``), the second's mesh ordering the devices in reverse (or alike),
    dispatched alternately ``ITERATIONS`` times with nothing read until the end; unbounded, and admitted to
    ``jmp.runtime.programs_in_flight`` at most 2 at a time. A run with no result after ``TIMEOUT`` s is
    deadlocked (the processes' rendezvous says which threads never arrived).

Training that reads nothing
    The plain-torch top-2 MoE of ``tests/sharding/models.py`` at ``expert_parallel_degree`` 8 over 2 processes x 4
    devices, SGD, ``TRAIN_STEPS`` steps whose losses are read only after the last, with
    ``JMP_CPU_STEPS_IN_FLIGHT=0`` (jmp's bound off: what jmp did before) and with the default bound (2 steps).
    Then the bound's cost: ``COST_STEPS`` steps (few enough that the unbounded run mostly completes: 40 steps
    unbounded deadlocked once here), both settings alternated ``COST_REPEATS`` times, wall time per step from
    the first step's end to the last loss read (a run without result is counted, not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.multiprocess.reports import json_objects

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS, TIMEOUT = 60, 30
TRAIN_STEPS, TRAIN_TIMEOUT = 300, 150
COST_STEPS, COST_REPEATS = 15, 4
LAUNCHER = [sys.executable, "-c", "import runpy; runpy.run_path('jmp/launch.py', run_name='__main__')"]
TWO_PROCESSES = [*LAUNCHER, "-n", "2", "--cpu-devices", "4"]


def _run(command: list[str], timeout: float, **env: str) -> dict:
    """The run's JSON lines, or that it gave none within ``timeout`` s (its processes then stopped)."""
    environment = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "20"} | env
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        return {"status": f"deadlocked (no result after {timeout} s)"}
    lines = json_objects(out)  # the processes' lines can run together
    if process.returncode != 0 or not lines:
        return {"status": f"failed ({process.returncode})", "stderr": err[-2000:]}
    return {"status": "completed", "wall_s": round(time.perf_counter() - start, 2), "reports": lines}


def queued_programs() -> list[dict]:
    rows = []
    for processes in (1, 2):
        for order in ("reversed", "same"):
            for mode in ("unbounded", "bounded"):
                script = ["tests/multiprocess/queued_programs_script.py", mode, str(ITERATIONS), order]
                if processes == 1:
                    result = _run([sys.executable, *script], TIMEOUT, XLA_FLAGS=_devices(8), JAX_PLATFORMS="cpu")
                else:
                    result = _run([*TWO_PROCESSES, *script], TIMEOUT)
                row = {"processes": processes, "second_mesh": order, "mode": mode, "programs": 2 * ITERATIONS}
                rows.append(row | {"status": result["status"]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _devices(count: int) -> str:
    return f"--xla_force_host_platform_device_count={count}"


def _train(steps: int, bound: str | None, timeout: float) -> dict:
    env = {} if bound is None else {"JMP_CPU_STEPS_IN_FLIGHT": bound}
    return _run([*TWO_PROCESSES, "-m", "benchmarks.programs_in_flight", "--train", str(steps)], timeout, **env)


def training() -> dict:
    long_runs = {
        name: {k: v for k, v in _train(TRAIN_STEPS, bound, TRAIN_TIMEOUT).items() if k != "stderr"}
        for name, bound in (("unbounded (JMP_CPU_STEPS_IN_FLIGHT=0)", "0"), ("bounded (default, 2 steps)", None))
    }
    print(json.dumps(long_runs), flush=True)
    per_step: dict[str, list[float]] = {"unbounded": [], "bounded": []}
    deadlocked = {"unbounded": 0, "bounded": 0}
    for _ in range(COST_REPEATS):
        for name, bound in (("unbounded", "0"), ("bounded", None)):
            result = _train(COST_STEPS, bound, TRAIN_TIMEOUT)
            if result["status"] != "completed":
                deadlocked[name] += 1
                continue
            per_step[name].append(max(r["seconds_per_step"] for r in result["reports"]))
    cost = {name: statistics.median(times) for name, times in per_step.items() if times}
    return {
        "steps": TRAIN_STEPS,
        "runs": long_runs,
        "cost": {
            "steps": COST_STEPS,
            "seconds_per_step": per_step,
            "runs_without_result": deadlocked,
            "bounded_over_unbounded": round(cost["bounded"] / cost["unbounded"], 3) if len(cost) == 2 else None,
        },
    }


def train_worker(steps: int) -> None:
    """In each launched process: the MoE trained ``steps`` steps, its losses read after the last."""
    import torch
    import torch.nn.functional as F

    import jmp as smp
    from jmp.runtime import programs_in_flight
    from tests.sharding.models import MoENet

    smp.init({"expert_parallel_degree": 8})
    torch.manual_seed(0)
    model = smp.DistributedModel(MoENet())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 6, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)
    share = slice(smp.dp_rank() * 8, smp.dp_rank() * 8 + 8)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        losses.append(train_step(model, x[share], y[share]))
        optimizer.step()
        if step == 0:  # compiled: the clock starts
            float(losses[0].reduce_mean())
            start = time.perf_counter()
    values = [float(loss.reduce_mean()) for loss in losses]
    seconds = (time.perf_counter() - start) / (steps - 1)
    report = {"rank": smp.rank(), "bound": programs_in_flight.limit(), "seconds_per_step": seconds}
    print(json.dumps(report | {"first_loss": values[0], "last_loss": values[-1]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "programs_in_flight.json"))
    parser.add_argument("--train", type=int, help=argparse.SUPPRESS)  # a launched process's work
    options = parser.parse_args()
    if options.train:
        train_worker(options.train)
        return
    results = {"queued_programs": queued_programs(), "training_without_reads": training()}
    Path(options.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
