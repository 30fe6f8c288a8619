"""What the out-of-range index checks cost: GPT-2 steps with and without them, side by side.

    python -m benchmarks.index_checks [--steps 20] [--out benchmarks/results/index_checks.json]

The checks (``jmp/torch_bridge/index_checks.py``: the token ids of the two embeddings and the labels of the loss,
each a compare and a max over indices the step reads anyway, carried out as side outputs) are switched by
``JMP_INDEX_CHECKS`` when a model's step is traced, so each run is its own model: ``step_speed``'s GPT-2 (4
layers, d_model 256, batch 8 x 128, AdamW) on 1 device and on 8 emulated devices, each with and without checks,
interleaved (medians after warm-up). Each iteration reads the loss, as a logging loop does. XLA's cost analysis
of the 1-device program with and without the checks (flops, bytes accessed) is recorded too: on a shared 2-core
machine the timings' noise is larger than the checks.
"""

from __future__ import annotations

import argparse
import functools
import os

import jmp as smp
from benchmarks.harness import emulate_devices, lm_step, machine, medians, time_interleaved, token_ids, write_results
from benchmarks.step_speed import GPT2, GPT2_BATCH, GPT2_SEQUENCE, gpt2_model, gpt2_optimizer, init, jmp_run

RUNS = {"1dev": ({"microbatches": 1}, 1), "dp8": ({"microbatches": 1, "ddp": True}, None)}


def _run(config: dict, devices: int | None, ids, checked: bool):
    previous = os.environ.get("JMP_INDEX_CHECKS")
    os.environ["JMP_INDEX_CHECKS"] = "1" if checked else "0"
    try:  # the first iteration traces the step: the switch is read then
        return jmp_run(gpt2_model, gpt2_optimizer, config, devices, lambda model: lm_step(model, ids))
    finally:
        if previous is None:
            del os.environ["JMP_INDEX_CHECKS"]
        else:
            os.environ["JMP_INDEX_CHECKS"] = previous


def _cost(ids, checked: bool) -> dict[str, float]:
    """XLA's cost analysis of the 1-device step program (flops, bytes accessed), with or without the checks."""
    previous = os.environ.get("JMP_INDEX_CHECKS")
    os.environ["JMP_INDEX_CHECKS"] = "1" if checked else "0"
    try:
        init({"microbatches": 1}, 1)
        model = smp.DistributedModel(gpt2_model())
        cost = lm_step.lower(model, ids).compile().cost_analysis()
    finally:
        if previous is None:
            del os.environ["JMP_INDEX_CHECKS"]
        else:
            os.environ["JMP_INDEX_CHECKS"] = previous
    cost = cost[0] if isinstance(cost, list) else cost
    return {key: float(cost[key]) for key in ("flops", "bytes accessed") if key in cost}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--out", default="benchmarks/results/index_checks.json")
    args = parser.parse_args()
    emulate_devices(8)
    ids = token_ids(GPT2_BATCH, GPT2_SEQUENCE, GPT2["vocab"])
    runs, first, prepare = {}, {}, {}
    for layout, (config, devices) in RUNS.items():
        for checked in (True, False):
            name = f"{layout}_{'checked' if checked else 'unchecked'}"
            iteration, first[name] = _run(config, devices, ids, checked)
            runs[name] = lambda iteration=iteration: float(iteration()[0])  # the loss read, as a loop logs it
            prepare[name] = functools.partial(init, config, devices)
    median = medians(time_interleaved(runs, args.steps, warmup=3, prepare=prepare))
    costs = {name: _cost(ids, checked) for name, checked in (("checked", True), ("unchecked", False))}
    result = {
        "machine": machine(),
        "steps": args.steps,
        "xla_cost_1dev": costs,
        "xla_cost_checked_over_unchecked": {
            key: costs["checked"][key] / costs["unchecked"][key] for key in costs["checked"]
        },
        "first_loss": first,
        "median_step_ms": {name: seconds * 1e3 for name, seconds in median.items()},
        "checked_over_unchecked": {
            layout: median[f"{layout}_checked"] / median[f"{layout}_unchecked"] for layout in RUNS
        },
    }
    print(result["median_step_ms"], result["checked_over_unchecked"], costs, flush=True)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
