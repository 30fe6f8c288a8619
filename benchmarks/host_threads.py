"""XLA:CPU's deadlock when collectives wait on every thread of its pool, and the pool jmp asks for (``host_threads``).

    python -m benchmarks.host_threads [--runs 8] [--cases llama-fsdp8-f32 ...] [--out results/host_threads.json]

Each run is a fresh process (``--worker``) on 8 emulated CPU devices: a case of ``benchmarks.estimate_peak`` (Hugging
Face transformers' ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` built from a config, AdamW, batch 8 x 128) trains
``STEPS`` steps of ``@smp.step`` + ``optimizer.step()``, reading each loss (layout ``1dev``: a mesh of one of the
8 devices, as a program the user runs on one device). Two pools, alternated run by run: XLA's own (``PJRT_NPROC`` =
max(cores, devices), what JAX makes without jmp) and jmp's default (``host_threads.LEVELS`` threads a device). XLA
aborts a collective that waited ``TERMINATE`` s (its rendezvous then says which devices never arrived): such a run
is counted as deadlocked. ``median_step_s``: the median of each completed run's steps after
the first two (the compile and the heaps settling), side by side with the same case's other pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STEPS, TERMINATE, DEVICES = 10, 60, 8
CASES = ("llama-fsdp8-f32", "llama-pp2xdp4-f32", "gpt2-fsdp8-bf16", "gpt2-1dev-f32")


def worker(case: str) -> None:
    import jax
    import torch
    import transformers

    import jmp as smp
    from benchmarks.estimate_peak import BATCH, DTYPES, LAYOUTS, LENGTH, MODELS

    name, layout, dtype = case.rsplit("-", 2)
    spec, config = MODELS[name], {**LAYOUTS.get(layout, {}), **DTYPES[dtype]}

    @smp.step
    def lm_step(model, batch):
        loss = model(**batch)["loss"]
        model.backward(loss)
        return loss

    ids = torch.randint(0, spec["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    smp.init(config, devices=jax.devices()[:1] if layout == "1dev" else None)
    hf = getattr(transformers, spec["kind"])(**{k: v for k, v in spec.items() if k != "kind"})
    with smp.delay_param_initialization(True):
        module = transformers.AutoModelForCausalLM.from_config(hf).train()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    times, losses = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        losses.append(float(lm_step(model, batch).reduce_mean()))
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(model.training_state.params)
        times.append(time.perf_counter() - start)
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    print("RESULT " + json.dumps({"pool_threads": names.count("tf_XLAEigen"), "step_s": times, "losses": losses}))


def run(case: str, pool: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PJRT_NPROC"}
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={DEVICES} "
        f"--xla_cpu_collective_call_terminate_timeout_seconds={TERMINATE}"
    )
    if pool == "xla":
        env["PJRT_NPROC"] = str(max(os.cpu_count() or 1, DEVICES))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_threads", "--worker", case],
        env=env, capture_output=True, text=True, timeout=20 * TERMINATE,
    )  # fmt: skip
    wall = round(time.perf_counter() - start, 1)
    lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode == 0 and lines:
        result = json.loads(lines[-1])
        median = statistics.median(result["step_s"][2:])
        return {"status": "completed", "wall_s": wall, **result, "median_step_s": median}
    deadlocked = "Termination timeout" in done.stderr
    said = [line[:300] for line in done.stderr.splitlines() if "Termination timeout" in line][:1]
    status = "deadlocked" if deadlocked else f"failed ({done.returncode})"
    return {"status": status, "wall_s": wall, "stderr": said or [done.stderr[-600:]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--out", default="benchmarks/results/host_threads.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    results = {}
    for case in args.cases:
        runs = {"xla": [], "jmp": []}
        for index in range(args.runs):
            for pool in ("xla", "jmp") if index % 2 == 0 else ("jmp", "xla"):
                runs[pool].append(run(case, pool))
                print(case, pool, runs[pool][-1]["status"], runs[pool][-1]["wall_s"], flush=True)
        results[case] = {
            pool: {
                "pool_threads": sorted({r["pool_threads"] for r in done if "pool_threads" in r}),
                "deadlocked": sum(r["status"] == "deadlocked" for r in done),
                "completed": sum(r["status"] == "completed" for r in done),
                "median_step_s": statistics.median([r["median_step_s"] for r in done if "median_step_s" in r] or [0]),
                "runs": done,
            }
            for pool, done in runs.items()
        }
        xla, jmp_ = results[case]["xla"]["median_step_s"], results[case]["jmp"]["median_step_s"]
        results[case]["jmp_over_xla_step"] = round(jmp_ / xla, 3) if xla and jmp_ else None
    with open(args.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "devices": DEVICES, "steps": STEPS, "cases": results}, f, indent=1)
    for case, result in results.items():
        print(case, {pool: (result[pool]["deadlocked"], result[pool]["completed"]) for pool in ("xla", "jmp")},
              "jmp/xla step", result["jmp_over_xla_step"])  # fmt: skip


if __name__ == "__main__":
    main()
