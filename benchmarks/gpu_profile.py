"""Where a jmp training step's time goes on one GPU: device time by compiled program and by kernel, and host time.

    python -m benchmarks.gpu_profile [--model gpt2|llama] [gpu_speed's size arguments] [--jmp-config bf16]
        [--steps 5] [--out benchmarks/results/gpu_profile.json]

The model, data and step are ``benchmarks.gpu_speed``'s jmp side (one ``--jmp-configs`` entry): a few untimed
steps, then ``--steps`` steps under ``jax.profiler.trace``, each step ``zero_grad``, ``lm_step``, reading the loss,
``optimizer.step()`` and waiting for the parameters, as gpu_speed times them. From the trace (XLA's own
profiler planes, read with ``jax.profiler.ProfileData``), per step: each compiled program's device time (the
"XLA Modules" line: the step program, the update, jmp's small helpers), the kernels by device time (the "XLA
Ops" line: fusions, cuBLAS / cuDNN calls, copies), the device's busy time against the step's wall time (what is
left is the device waiting for the host), and the host's time per jmp call. On a CPU the same runs with XLA:CPU's
planes (a check of this script, not a GPU figure).
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


def summarise(path: str, steps: int) -> dict:
    """Device and host time per step from the trace at ``path``, by line, program and kernel."""
    profile = ProfileData.from_file(path)
    devices, host = {}, collections.Counter()
    for plane in profile.planes:
        if plane.name.startswith("/device:"):
            lines = {}
            for line in plane.lines:
                by_name: collections.Counter = collections.Counter()
                for event in line.events:
                    by_name[event.name] += event.duration_ns
                lines[line.name] = by_name
            modules = lines.get("XLA Modules", collections.Counter())
            ops = lines.get("XLA Ops", collections.Counter())
            devices[plane.name] = {
                "busy_ms_per_step": sum(modules.values()) / 1e6 / steps,
                "programs_ms_per_step": {k: v / 1e6 / steps for k, v in modules.most_common()},
                "kernels_ms_per_step": {k: v / 1e6 / steps for k, v in ops.most_common(TOP)},
                "kernels_total_ms_per_step": sum(ops.values()) / 1e6 / steps,
                "lines": sorted(lines),
            }
        elif plane.name == "/host:CPU":
            for line in plane.lines:
                if line.name == "python":  # the traced Python calls: jit dispatches and jmp's annotations
                    for event in line.events:
                        host[event.name] += event.duration_ns
    return {
        "devices": devices,
        "host_ms_per_step": {k: v / 1e6 / steps for k, v in host.most_common(TOP)},
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
