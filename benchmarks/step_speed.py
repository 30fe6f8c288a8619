"""Step time of jmp configurations against PyTorch eager, and what compiling costs with and without the cache.

    python -m benchmarks.step_speed [--steps 10] [--skip-main-job] [--out benchmarks/results/step_speed.json]

Two models, each trained side by side in one process (medians of interleaved steps after warm-up):

- the seed's GroupedNet (batch 64 of 1x28x28, Adadelta lr 4.0): PyTorch eager; jmp on 1 device with 1 and 4
  microbatches; 8 devices data parallel with 1 and 4 microbatches; the main job's 2 pipeline stages x 4
  data parallel with 4 microbatches;
- the GPT-2 of ``bridge_overhead`` (4 layers, d_model 256, batch 8 x 128, AdamW): PyTorch eager; jmp on 1
  device with 1 and 4 microbatches; 8 devices data parallel.

Then the main job (``python -m jmp.examples.mnist``, 3 epochs) runs twice in a subprocess with an empty
compilation cache directory: the first run compiles, the second loads every program from the cache. Its
wall time, the three epochs' time and the compile seconds it logs are recorded for both runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import torch
import torch.nn.functional as F
import transformers

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    gpt2_config,
    lm_step,
    machine,
    medians,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.examples.models import GroupedNet
from jmp.runtime import compilation_cache as compilation

IMAGES = 64
GPT2 = dict(vocab=2048, positions=128, d_model=256, layers=4, heads=4)
GPT2_BATCH, GPT2_SEQUENCE = 8, 128

# name -> (config, devices: None = all)
GROUPED_NET_RUNS = {
    "jmp_1dev_mb1": ({"microbatches": 1}, 1),
    "jmp_1dev_mb4": ({"microbatches": 4}, 1),
    "jmp_dp8_mb1": ({"microbatches": 1, "ddp": True}, None),
    "jmp_dp8_mb4": ({"microbatches": 4, "ddp": True}, None),
    "jmp_pp2_dp4_mb4": (
        {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "auto_partition": True, "ddp": True},
        None,
    ),
}
GPT2_RUNS = {
    "jmp_1dev_mb1": ({"microbatches": 1}, 1),
    "jmp_1dev_mb4": ({"microbatches": 4}, 1),
    "jmp_dp8_mb1": ({"microbatches": 1, "ddp": True}, None),
}


@smp.step
def grouped_net_step(model, data, target):
    loss = F.nll_loss(model(data), target)
    model.backward(loss)
    return loss


def grouped_net_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(IMAGES, 1, 28, 28, generator=generator), torch.randint(0, 10, (IMAGES,), generator=generator)


def init(config: dict, devices: int | None) -> None:
    smp.init(config, devices=None if devices is None else jax.devices()[:devices])


def jmp_run(make_model, make_optimizer, config, devices, step):
    """A jmp training iteration of a fresh copy of the model under ``config``: (callable, first loss)."""
    init(config, devices)
    model = smp.DistributedModel(make_model())
    optimizer = smp.DistributedOptimizer(make_optimizer(model.module.parameters()))

    def iteration():
        optimizer.zero_grad()
        loss = step(model).reduce_mean()
        optimizer.step()
        # the update too: XLA:CPU's collectives can deadlock when programs over differently ordered
        # meshes (the runs here) are in flight at once
        return loss, model.training_state.params

    return iteration, float(iteration()[0])


def torch_run(make_model, make_optimizer, loss_of):
    model = make_model()
    optimizer = make_optimizer(model.parameters())

    def iteration():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return iteration, float(iteration())


def measure(name, make_model, make_optimizer, torch_loss, jmp_step, runs_spec, steps):
    """Median seconds per iteration of PyTorch eager and each jmp configuration, interleaved."""
    runs, first = {}, {}
    runs["torch_eager"], first["torch_eager"] = torch_run(make_model, make_optimizer, torch_loss)
    for run, (config, devices) in runs_spec.items():
        start = time.perf_counter()
        runs[run], first[run] = jmp_run(make_model, make_optimizer, config, devices, jmp_step)
        print(f"{name} {run}: first step {time.perf_counter() - start:.1f} s", flush=True)
    prepare = {run: functools.partial(init, *runs_spec[run]) for run in runs_spec}
    median = medians(time_interleaved(runs, steps, warmup=3, prepare=prepare))
    print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in median.items()), flush=True)
    return {
        "first_loss": first,
        "median_step_ms": {k: v * 1e3 for k, v in median.items()},
        "over_torch_eager": {k: v / median["torch_eager"] for k, v in median.items() if k != "torch_eager"},
    }


def grouped_net(steps: int) -> dict:
    data, target = grouped_net_data()

    def make_model():
        torch.manual_seed(0)
        return GroupedNet()

    result = measure(
        "GroupedNet",
        make_model,
        lambda params: torch.optim.Adadelta(params, lr=4.0),
        lambda model: F.nll_loss(model(data), target),
        lambda model: grouped_net_step(model, data, target),
        GROUPED_NET_RUNS,
        steps,
    )
    ms = result["median_step_ms"]
    result["microbatched_over_one"] = {
        "1dev": ms["jmp_1dev_mb4"] / ms["jmp_1dev_mb1"],
        "dp8": ms["jmp_dp8_mb4"] / ms["jmp_dp8_mb1"],
    }
    return result


def gpt2(steps: int) -> dict:
    ids = token_ids(GPT2_BATCH, GPT2_SEQUENCE, GPT2["vocab"])
    result = measure(
        "GPT-2",
        lambda: causal_lm(gpt2_config(**GPT2)),
        lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4),
        lambda model: model(input_ids=ids, labels=ids, use_cache=False).loss,
        lambda model: lm_step(model, ids),
        GPT2_RUNS,
        steps,
    )
    ms = result["median_step_ms"]
    result["microbatched_over_one"] = {"1dev": ms["jmp_1dev_mb4"] / ms["jmp_1dev_mb1"]}
    return result


_COMPILED = re.compile(r"^(compiled|loaded from the compilation cache) (\w+) in ([\d.]+) s", re.MULTILINE)
_EPOCH = re.compile(r"epoch \d+/\d+ .*\(([\d.]+)s\)")


def main_job_runs() -> dict:
    """The main job twice with one fresh cache directory: wall seconds, epoch seconds, compile seconds."""
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JMP_COMPILATION_CACHE=cache, PYTHONPATH=os.getcwd())
        env.pop("XLA_FLAGS", None)
        for run in ("first_run", "cached_run"):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "jmp.examples.mnist"], env=env, capture_output=True, text=True, check=True
            )
            wall = time.perf_counter() - start
            log = done.stdout + done.stderr
            compiled = [(how, name, float(s)) for how, name, s in _COMPILED.findall(log)]
            results[run] = {
                "wall_seconds": wall,
                "epochs_seconds": sum(float(s) for s in _EPOCH.findall(log)),
                "compile_seconds": sum(s for _, _, s in compiled),
                "programs": [f"{how} {name} in {s:.2f} s" for how, name, s in compiled],
                "accuracy_line": [line for line in log.splitlines() if "accuracy" in line][-1:],
            }
            print(f"main job {run}: {json.dumps(results[run])}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/step_speed.json")
    args = parser.parse_args()
    os.environ.setdefault(compilation.ENVIRONMENT, "off")  # first steps here compile; the main job's runs say
    transformers.logging.set_verbosity_error()
    emulate_devices()
    result = {"machine": machine(), "torch_threads": torch.get_num_threads()}
    result["grouped_net"] = grouped_net(args.steps)
    result["gpt2"] = gpt2(args.steps)
    if not args.skip_main_job:
        result["main_job"] = main_job_runs()
    write_results(args.out, result)
    print(json.dumps(result, indent=2))
    losses = result["gpt2"]["first_loss"]  # GroupedNet's dropout draws differ between torch and jmp
    np.testing.assert_allclose(list(losses.values()), losses["torch_eager"], rtol=1e-3)


if __name__ == "__main__":
    main()
