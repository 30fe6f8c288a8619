"""Pipeline schedules (simple = GPipe, interleaved = 1F1B) against the number of microbatches: ticks, memory, FLOPs.

    python -m benchmarks.pipeline [--steps 5] [--out benchmarks/results/pipeline.json]

GPT-2 (Hugging Face, from a config: 4 layers, d_model 64, 4 heads, vocab 128)
over 8 emulated CPU devices with ``pipeline_parallel_degree`` 4 (so data parallelism 2), trained with
``torch.optim.AdamW`` through ``@smp.step`` and ``smp.DistributedOptimizer``. The microbatch size is fixed
(2 rows per data-parallel shard, sequence 16): the batch is ``microbatches x 2 x dp`` rows, so more
microbatches means more work per step, not smaller pieces of the same batch.

Per schedule, ``pipeline_recompute`` (False: a stage keeps its backward's residuals; True: it keeps its
input and runs its forward again in the backward) and microbatch count M:

- ``ticks``, ``slots``, ``idle fraction``: from ``jmp.pipeline.schedule.build(kind, 4, M)``: the ticks of
  the step program's scan, the microbatch inputs (and cotangents) a stage keeps at once, and the fraction
  of stage-ticks spent idle. ``textbook bubble`` is (pp - 1) / (M + pp - 1), GPipe's idle fraction when a
  forward and a backward take one tick each.
- ``FLOPs / unpipelined``: the work of one microbatch through every stage, forward and backward, over the
  same microbatch's work in the step without a pipeline (``pipeline_parallel_degree`` 1, data parallel over
  all 8 devices, so a device's microbatch has the same rows), both from ``cost_analysis()`` of the compiled
  step. XLA's cost analysis counts a loop body once and the most expensive branch of a ``lax.switch``, so
  the pipelined figure comes from the same step compiled with every stage branch evaluated at each tick
  (``lax.switch`` replaced by a select, for this measurement only): one tick's body is then one microbatch
  through every stage's forward and backward, plus the idle branch and the selects. Both programs are
  compiled without common-subexpression elimination, which would otherwise merge a stage's forward branch
  with the forward its backward branch traces again (they read the same operands only in this measurement).
- ``temp``: ``memory_analysis().temp_size_in_bytes`` of the compiled step (bytes per device), and its ratio
  to the same schedule at M = 4. ``scan KiB``: the bytes of the pipeline scan's loop state (the kept
  microbatch inputs and cotangents, the stage's packed parameters and gradient accumulator, the per-
  microbatch results), read from the optimized HLO: what the schedule itself holds across ticks.
- ``step s``: median seconds of ``@smp.step`` (forward and backward, no optimizer update) over the timed
  steps after two warm-up steps (``smp.init`` is global, so each configuration is timed in turn).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import torch
import transformers

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    gpt2_config,
    hlo_shapes,
    lm_step,
    machine,
    shape_bytes,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.pipeline import schedule

PP, HIDDEN, LAYERS, HEADS, VOCAB, POSITIONS, SEQUENCE, ROWS_PER_MICROBATCH, LR = 4, 64, 4, 4, 128, 32, 16, 2, 1e-3
SCHEDULES = ("simple", "interleaved")
RECOMPUTE = (False, True)
MICROBATCHES = (4, 8, 16)
MIB, KIB = 2**20, 2**10

_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def scan_state_bytes(hlo: str, ticks: int) -> int | None:
    """Bytes of the loop state of the pipeline's scan: the ``while`` of the shard_map running ``ticks`` times."""
    for line in hlo.splitlines():
        trips = _TRIP_COUNT.search(line)
        if " while(" not in line or trips is None or int(trips[1]) != ticks or 'shard_map/while"' not in line:
            continue
        return sum(shape_bytes(dtype, dims) for dtype, dims in hlo_shapes(line.split(" while(")[0]))
    return None


@contextlib.contextmanager
def every_branch_evaluated() -> Iterator[None]:
    """Within the block, ``lax.switch`` evaluates every branch and selects one result, so that XLA's cost
    analysis (which counts only the most expensive branch of a conditional) counts them all."""
    switch = jax.lax.switch

    def selected(index, branches, *operands):
        results = [branch(*operands) for branch in branches]

        def pick(*leaves):
            chosen = leaves[0]
            for i, leaf in enumerate(leaves[1:], 1):
                chosen = jnp.where(index == i, leaf, chosen)
            return chosen

        return jax.tree.map(pick, *results)

    jax.lax.switch = selected
    try:
        yield
    finally:
        jax.lax.switch = switch


def step_flops(pp: int, microbatches: int, recompute: bool, every_branch: bool = False) -> float:
    """``cost_analysis()`` FLOPs of a freshly traced step (per device; loop bodies counted once)."""
    smp.init({"pipeline_parallel_degree": pp, "microbatches": microbatches, "pipeline_recompute": recompute})
    ids = token_ids(microbatches * ROWS_PER_MICROBATCH * (jax.device_count() // pp), SEQUENCE, VOCAB)
    net = causal_lm(gpt2_config(vocab=VOCAB, positions=POSITIONS, d_model=HIDDEN, layers=LAYERS, heads=HEADS))
    model = smp.DistributedModel(net)
    with every_branch_evaluated() if every_branch else contextlib.nullcontext():
        lm_step(model, ids)
        compiled = lm_step.lower(model, ids).compile(compiler_options={"xla_disable_hlo_passes": "cse"})
        return compiled.cost_analysis()["flops"]


def build(kind: str, recompute: bool, microbatches: int):
    """One configuration, its step run once and compiled: (step runner, row without timing)."""
    smp.init(
        {
            "pipeline_parallel_degree": PP,
            "microbatches": microbatches,
            "pipeline": kind,
            "pipeline_recompute": recompute,
        }
    )
    dp = jax.device_count() // PP
    batch = microbatches * ROWS_PER_MICROBATCH * dp
    ids = token_ids(batch, SEQUENCE, VOCAB)
    net = causal_lm(gpt2_config(vocab=VOCAB, positions=POSITIONS, d_model=HIDDEN, layers=LAYERS, heads=HEADS))
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=LR))
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = lm_step(model, ids)  # the first call partitions the model
    first_call = time.perf_counter() - start
    compiled = lm_step.lower(model, ids).compile()
    plan = schedule.build(kind, PP, microbatches)

    def run():
        optimizer.zero_grad()
        out = lm_step(model, ids)
        return out.stack()  # one program computes outputs and gradients: ready together

    row = {
        "schedule": kind,
        "recompute": recompute,
        "microbatches": microbatches,
        "batch": batch,
        "mesh": {k: v for k, v in smp.get_mesh().shape.items() if v > 1},
        "ticks": plan.ticks,
        "slots": plan.slots,
        "idle_fraction": plan.bubble,
        "textbook_bubble": (PP - 1) / (microbatches + PP - 1),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "scan_state_bytes": scan_state_bytes(compiled.as_text(), plan.ticks),
        "first_loss": float(loss.reduce_mean()),
        "first_call_seconds": first_call,
    }
    return run, row


def table(rows: list[dict]) -> str:
    header = (
        f"{'schedule':<12}{'recompute':>10}{'microbatches':>13}{'ticks':>7}{'slots':>7}{'idle fraction':>15}"
        f"{'textbook bubble':>17}{'temp MiB':>10}{'temp / temp at M=4':>20}{'step s':>9}{'scan KiB':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        scan = "-" if r["scan_state_bytes"] is None else f"{r['scan_state_bytes'] / KIB:.1f}"
        lines.append(
            f"{r['schedule']:<12}{r['recompute']!s:>10}{r['microbatches']:>13}{r['ticks']:>7}{r['slots']:>7}"
            f"{r['idle_fraction']:>15.3f}{r['textbook_bubble']:>17.3f}{r['temp_bytes'] / MIB:>10.3f}"
            f"{r['temp_ratio']:>20.3f}"
            f"{r['median_step_seconds']:>9.3f}{scan:>10}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    emulate_devices()

    rows = {}
    for kind in SCHEDULES:
        for recompute in RECOMPUTE:
            for m in MICROBATCHES:
                # smp.init is global (the step reads the current microbatches and schedule): each configuration
                # is built, warmed up and timed before the next one is initialized
                run, row = build(kind, recompute, m)
                times = time_interleaved({"step": run}, args.steps, warmup=2)["step"]
                row["median_step_seconds"] = statistics.median(times)
                row["step_seconds"] = times
                rows[kind, recompute, m] = row
                print(f"  {kind} recompute={recompute} M={m}: first call {row['first_call_seconds']:.1f}s", flush=True)
    for r in rows.values():
        r["temp_ratio"] = r["temp_bytes"] / rows[r["schedule"], r["recompute"], MICROBATCHES[0]]["temp_bytes"]
    unpipelined = step_flops(1, MICROBATCHES[0], False)
    flops = {
        recompute: step_flops(PP, MICROBATCHES[0], recompute, every_branch=True) / unpipelined
        for recompute in RECOMPUTE
    }

    print()
    print(
        f"GPT-2 {LAYERS} layers, d_model {HIDDEN}, pp={PP}, dp={jax.device_count() // PP}, "
        f"{ROWS_PER_MICROBATCH} rows x {SEQUENCE} tokens per microbatch per dp shard; temp = per-device temporaries "
        "of the compiled step"
    )
    print(
        f"step s: median of {args.steps} steps after warm-up, on {os.cpu_count()} shared CPU cores emulating "
        f"{jax.device_count()} devices: noisy, compare only large differences"
    )
    print()
    print(table(list(rows.values())))
    print()
    for recompute, ratio in flops.items():
        print(f"FLOPs of a microbatch through the pipeline / without it, pipeline_recompute={recompute}: {ratio:.3f}")
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**machine(), "transformers": transformers.__version__},
        "config": dict(
            model="gpt2",
            layers=LAYERS,
            d_model=HIDDEN,
            vocab=VOCAB,
            sequence=SEQUENCE,
            pipeline_parallel_degree=PP,
            rows_per_microbatch_per_dp_shard=ROWS_PER_MICROBATCH,
            optimizer="AdamW",
            dtype="float32",
            steps=args.steps,
            warmup_steps=2,
        ),
        "notes": [
            "batch = microbatches x rows_per_microbatch_per_dp_shard x dp: the microbatch size is fixed",
            "textbook_bubble = (pp - 1) / (microbatches + pp - 1); idle_fraction = idle stage-ticks / all",
            "scan_state_bytes: loop state of the pipeline's lax.scan in the optimized HLO (per device)",
            "timings on few shared CPU cores emulating 8 devices are noisy",
        ],
        "rows": list(rows.values()),
        "flops_relative_to_unpipelined": {f"pipeline_recompute={k}": v for k, v in flops.items()},
        "unpipelined_microbatch_flops": unpipelined,
    }
    write_results(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
