"""Where a jmp training step's time goes on one GPU: device time by compiled program and by kernel, and host time.

    python -m benchmarks.gpu_profile [--model gpt2|llama] [gpu_speed's size arguments] [--jmp-config bf16]
        [--steps 5] [--out benchmarks/results/gpu_profile.json]

The model, data and step are ``benchmarks.gpu_speed``'s jmp side (one ``--jmp-configs`` entry): a few untimed
steps, then ``--steps`` steps under ``jax.profiler.trace``, each step ``zero_grad``, ``lm_step``, reading the loss,
``optimizer.step()`` and waiting for the parameters, as gpu_speed times them. From the trace (XLA's own
profiler planes, read with ``jax.profiler.ProfileData``), per step: each compiled program's device time (the
"XLA Modules" line, or on a GPU the kernels' ``hlo_module``: the step program, the update, jmp's small helpers),
the HLO ops and kernels by device time (fusions, cuBLAS / cuDNN calls, copies), the device's busy time against the
step's wall time (what is left is the device waiting for the host), and the host's time per jmp call. On a CPU
the same runs with XLA:CPU's planes (a check of this script, not a GPU figure).
"""

from __future__ import annotations

import argparse
import collections
import copy
import glob
import tempfile
import time

import jax
import torch
import transformers
from jax.profiler import ProfileData

import jmp as smp
from benchmarks import gpu_speed
from benchmarks.harness import causal_lm, lm_step, machine, token_ids, write_results

TOP = 25  # kernels listed


def profiled_steps(args) -> tuple[str, list[float]]:
    """Train ``args.steps`` steps under the profiler; returns the trace's file and each step's wall seconds."""
    smp.init(gpu_speed.jmp_config(args.jmp_config))
    base = causal_lm(gpu_speed.model_spec(args))
    model = smp.DistributedModel(copy.deepcopy(base))
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.module.parameters(), lr=gpu_speed.LR, weight_decay=gpu_speed.WEIGHT_DECAY)
    )
    ids = token_ids(args.batch, args.seq, args.vocab)

    def step():
        optimizer.zero_grad()
        loss = lm_step(model, ids).reduce_mean()
        optimizer.step()
        jax.block_until_ready(model.training_state.params)
        return float(loss)

    for _ in range(3):  # compiled, then steady
        step()
    directory = tempfile.mkdtemp(prefix="jmp-gpu-profile-")
    walls = []
    with jax.profiler.trace(directory):
        for _ in range(args.steps):
            start = time.perf_counter()
            with jax.profiler.TraceAnnotation("jmp_training_step"):
                step()
            walls.append(time.perf_counter() - start)
    return glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0], walls


def _merged_ns(intervals: list[tuple[float, float]]) -> float:
    """The time covered by ``intervals`` (start, end), overlaps counted once: a device busy on several streams."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def _device_summary(plane, steps: int) -> dict:
    """One device plane's time per step. XLA:CPU's planes have "XLA Modules" and "XLA Ops" lines; a GPU's have one
    line per CUDA stream ("Stream #14(Compute)"), whose events are kernels carrying ``hlo_module`` / ``hlo_op``
    stats (the session of 2026-11-26 found only those on an H100)."""
    modules, ops, kernels = collections.Counter(), collections.Counter(), collections.Counter()
    intervals, lines = [], {}
    for line in plane.lines:
        total = 0.0
        for event in line.events:
            total += event.duration_ns
            if line.name == "XLA Modules":
                modules[event.name] += event.duration_ns
            elif line.name == "XLA Ops" or line.name.startswith("Stream"):
                kernels[event.name] += event.duration_ns
                intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                if line.name.startswith("Stream"):
                    stats = dict(event.stats)
                    modules[str(stats.get("hlo_module", "(no hlo_module)"))] += event.duration_ns
                    ops[str(stats.get("hlo_op", event.name))] += event.duration_ns
        lines[line.name] = total / 1e6 / steps
    if not ops:  # XLA:CPU: its ops are the kernels
        ops = kernels
    per_step = lambda counter, top=None: {k: v / 1e6 / steps for k, v in counter.most_common(top)}  # noqa: E731
    return {
        "busy_ms_per_step": _merged_ns(intervals) / 1e6 / steps,
        "programs_ms_per_step": per_step(modules),
        "ops_ms_per_step": per_step(ops, TOP),
        "kernels_ms_per_step": per_step(kernels, TOP),
        "kernels_total_ms_per_step": sum(kernels.values()) / 1e6 / steps,
        "lines_ms_per_step": lines,
    }


def summarise(path: str, steps: int) -> dict:
    """Device and host time per step from the trace at ``path``, by line, program and kernel."""
    profile = ProfileData.from_file(path)
    devices, host, host_lines = {}, collections.Counter(), {}
    for plane in profile.planes:
        if plane.name.startswith("/device:"):
            devices[plane.name] = _device_summary(plane, steps)
        elif plane.name.startswith("/host:"):
            for line in plane.lines:
                host_lines[f"{plane.name} {line.name}"] = sum(e.duration_ns for e in line.events) / 1e6 / steps
                if line.name == "python":  # the traced Python calls: jit dispatches and jmp's annotations
                    for event in line.events:
                        host[event.name] += event.duration_ns
    return {
        "devices": devices,
        "host_ms_per_step": {k: v / 1e6 / steps for k, v in host.most_common(TOP)},
        "host_lines_ms_per_step": host_lines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--jmp-config", default="bf16", help=f"one entry, words of {list(gpu_speed.CONFIG_WORDS)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/gpu_profile.json")
    args = parser.parse_args()
    if set(args.jmp_config.split("+")) - set(gpu_speed.CONFIG_WORDS):
        parser.error(f"--jmp-config {args.jmp_config!r}: words are {list(gpu_speed.CONFIG_WORDS)}")
    transformers.logging.set_verbosity_error()
    path, walls = profiled_steps(args)
    summary = summarise(path, args.steps)
    wall_ms = sum(walls) / len(walls) * 1e3
    print(f"{jax.devices()[0].device_kind}: {wall_ms:.1f} ms a step (wall, under the profiler)")
    for name, device in summary["devices"].items():
        print(f"{name}: device busy {device['busy_ms_per_step']:.1f} ms a step")
        for program, ms in device["programs_ms_per_step"].items():
            print(f"  program {program[:70]:<70} {ms:8.2f} ms")
        for op, ms in list(device["ops_ms_per_step"].items())[:15]:
            print(f"  op      {op[:70]:<70} {ms:8.2f} ms")
        for kernel, ms in list(device["kernels_ms_per_step"].items())[:15]:
            print(f"  kernel  {kernel[:70]:<70} {ms:8.2f} ms")
    for call, ms in list(summary["host_ms_per_step"].items())[:10]:
        print(f"  host    {call[:70]:<70} {ms:8.2f} ms")
    write_results(
        args.out,
        {
            "what": __doc__.split("\n\n")[0],
            "machine": machine(),
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "wall_ms_per_step": wall_ms,
            **summary,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
