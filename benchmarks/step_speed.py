"""Step time of jmp configurations against PyTorch eager, and what compiling costs with and without the cache.

    python -m benchmarks.step_speed [--steps 10] [--skip-main-job] [--out benchmarks/results/step_speed.json]

Two processes measure: one with JAX's single CPU device (what a laptop user gets) for the 1-device runs, one with
8 emulated devices for the data-parallel and pipeline runs. On this 2-core machine the emulation alone makes a
1-device program 1.3-1.4x slower (XLA:CPU's thread pools grow with the device count and contend for the two
cores), so the second process runs the 1-device, 1-microbatch configuration too, to show that cost.

Two models, each trained side by side in one process (medians of interleaved steps after warm-up):

- the seed's GroupedNet (batch 64 of 1x28x28, Adadelta lr 4.0): PyTorch eager; torch.compile; jmp on 1 device
  with 1 and 4 microbatches; 8 devices data parallel with 1 and 4 microbatches; the main job's 2 pipeline
  stages x 4 data parallel with 4 microbatches;
- the GPT-2 of ``bridge_overhead`` (4 layers, d_model 256, batch 8 x 128, AdamW): PyTorch eager;
  torch.compile; the same GPT-2 hand-written in JAX (``reference_gpt2`` under ``jax.jit`` with optax AdamW,
  donated state); jmp on 1 device with 1 and 4 microbatches, and with ``scan_layers`` off (the default scans
  the 4 blocks); 8 devices data parallel.

Both also run jmp on 1 device compiled as before issue 37's CPU changes (``jmp_1dev_mb1_before``), so that
``after_over_before`` compares the two in one run. The machine's load average is recorded: on a shared 2-core
machine PyTorch's OpenMP threads slow down far more than XLA's under other processes' load.

torch.compile is inductor in its default mode on the forward with the loss (AOTAutograd compiles the backward)
and on ``optimizer.step`` (PyTorch's recipe for a compiled optimizer); its first two iterations (the compiles)
are timed apart from the steps, as jmp's first step is.

Then the main job (``python -m jmp.examples.mnist``, 3 epochs) runs twice in a subprocess with an empty
compilation cache directory: the first run compiles, the second loads every program from the cache. Its
wall time, the three epochs' time and the compile seconds it logs are recorded for both runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
import transformers
from flax import nnx

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
from benchmarks.reference_gpt2 import GPT2 as ReferenceGPT2
from benchmarks.reference_gpt2 import causal_lm_loss, from_hf
from jmp.examples.models import GroupedNet
from jmp.remat import xla as remat_xla
from jmp.runtime import compilation_cache as compilation
from jmp.torch_bridge.lowering import convolution

IMAGES = 64
GPT2 = dict(vocab=2048, positions=128, d_model=256, layers=4, heads=4)
GPT2_BATCH, GPT2_SEQUENCE = 8, 128


def gpt2_model() -> torch.nn.Module:
    """The GPT-2 these timings train (``GPT2``'s sizes, random weights of torch seed 0)."""
    return causal_lm(gpt2_config(**GPT2))


def gpt2_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


def gpt2_loss(ids: torch.Tensor):
    """The GPT-2's loss on ``ids`` as their own labels, as a function of the model (PyTorch's side)."""
    return lambda model: model(input_ids=ids, labels=ids, use_cache=False).loss


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
# jmp on 1 device as it compiled before issue 37's CPU changes, measured beside the rest (``previous_settings``)
BEFORE_RUNS = {"jmp_1dev_mb1_before": ({"microbatches": 1}, 1)}
GPT2_RUNS = {
    "jmp_1dev_mb1": ({"microbatches": 1}, 1),
    "jmp_1dev_mb1_unscanned": ({"microbatches": 1, "scan_layers": False}, 1),
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


@contextlib.contextmanager
def previous_settings():
    """Programs traced and compiled inside compile as before issue 37's CPU changes: XLA:CPU's default library
    fusions (YNNPACK convolutions included) and max pooling by the general path (variadic reduce_window,
    scatter gradient)."""
    options, tile = remat_xla.compiler_options, convolution._MAX_TILE
    remat_xla.compiler_options = lambda platform, fp8=False: (
        dict(remat_xla._KEEP_BARRIERS) if platform == "cpu" else None
    )
    convolution._MAX_TILE = 0
    try:
        yield
    finally:
        remat_xla.compiler_options, convolution._MAX_TILE = options, tile


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


def torch_compiled_run(make_model, make_optimizer, loss_of):
    """PyTorch's iteration under torch.compile: (callable, first loss, seconds of the first two iterations)."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    compiled_loss = torch.compile(loss_of)
    compiled_update = torch.compile(optimizer.step)

    def iteration():
        optimizer.zero_grad(set_to_none=True)
        loss = compiled_loss(model)
        loss.backward()
        compiled_update()
        return loss.detach()

    start = time.perf_counter()
    first = float(iteration())
    iteration()  # the optimizer's state exists from the second step on: its update compiles again
    return iteration, first, time.perf_counter() - start


def handwritten_jax_step(ids: torch.Tensor):
    """The GPT-2 as a JAX user writes it: a plain Flax NNX model (``reference_gpt2``, the Hugging Face weights
    copied in) split once into arrays, and ``jax.jit`` of loss, gradient and optax AdamW with the parameters and
    optimizer state donated: (the jitted step, its [parameters, optimizer state], the tokens)."""
    reference = ReferenceGPT2(GPT2["vocab"], GPT2["positions"], GPT2["d_model"], GPT2["layers"], GPT2["heads"])
    from_hf(reference, gpt2_model())
    graphdef, params = nnx.split(reference)
    update = optax.adamw(1e-4, weight_decay=1e-4)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: causal_lm_loss(nnx.merge(graphdef, p)(tokens), tokens))(params)
        updates, opt_state = update.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, [params, update.init(params)], jnp.asarray(ids.numpy())


def handwritten_jax_run(ids: torch.Tensor):
    """``handwritten_jax_step`` as an iteration: (callable, first loss)."""
    step, state, tokens = handwritten_jax_step(ids)

    def iteration():
        state[0], state[1], loss = step(state[0], state[1], tokens)
        return loss

    return iteration, float(iteration())


def measure(name, make_model, make_optimizer, torch_loss, jmp_step, runs_spec, steps, extra=None):
    """Median seconds per iteration of PyTorch eager, torch.compile, each jmp configuration and ``extra``
    (name -> (callable, first loss)), interleaved."""
    runs, first = {}, {}
    for run, (call, loss) in (extra or {}).items():
        runs[run], first[run] = call, loss
    runs["torch_eager"], first["torch_eager"] = torch_run(make_model, make_optimizer, torch_loss)
    runs["torch_compile"], first["torch_compile"], compile_warmup = torch_compiled_run(
        make_model, make_optimizer, torch_loss
    )
    print(f"{name} torch_compile: first two steps {compile_warmup:.1f} s", flush=True)
    first_step = {}
    for run, (config, devices) in runs_spec.items():
        start = time.perf_counter()
        with previous_settings() if run in BEFORE_RUNS else contextlib.nullcontext():  # the first step compiles
            runs[run], first[run] = jmp_run(make_model, make_optimizer, config, devices, jmp_step)
        first_step[run] = time.perf_counter() - start
        print(f"{name} {run}: first step {first_step[run]:.1f} s", flush=True)
    prepare = {run: functools.partial(init, *runs_spec[run]) for run in runs_spec}
    median = medians(time_interleaved(runs, steps, warmup=3, prepare=prepare))
    print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in median.items()), flush=True)
    return {
        "first_loss": first,
        "warmup_seconds": {"torch_compile_first_two_steps": compile_warmup, **first_step},
        "median_step_ms": {k: v * 1e3 for k, v in median.items()},
        "over_torch_eager": {k: v / median["torch_eager"] for k, v in median.items() if k != "torch_eager"},
        "over_torch_compile": {k: v / median["torch_compile"] for k, v in median.items() if k != "torch_compile"},
    }


def one_device_runs(runs: dict, one_device: bool) -> dict:
    """The runs one process measures: on one device, those of one device and the runs as compiled before; under
    emulation, the rest and 1 device at 1 microbatch, the emulation's cost."""
    if one_device:
        return {name: spec for name, spec in runs.items() if spec[1] == 1} | BEFORE_RUNS
    return {name: spec for name, spec in runs.items() if spec[1] != 1 or name == "jmp_1dev_mb1"}


def grouped_net(steps: int, one_device: bool) -> dict:
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
        one_device_runs(GROUPED_NET_RUNS, one_device),
        steps,
    )
    ms = result["median_step_ms"]
    if one_device:
        result["microbatched_over_one"] = {"1dev": ms["jmp_1dev_mb4"] / ms["jmp_1dev_mb1"]}
        result["after_over_before"] = ms["jmp_1dev_mb1"] / ms["jmp_1dev_mb1_before"]
    else:
        result["microbatched_over_one"] = {"dp8": ms["jmp_dp8_mb4"] / ms["jmp_dp8_mb1"]}
    return result


def gpt2(steps: int, one_device: bool) -> dict:
    ids = token_ids(GPT2_BATCH, GPT2_SEQUENCE, GPT2["vocab"])
    extra = {"handwritten_jax": handwritten_jax_run(ids)} if one_device else None
    result = measure(
        "GPT-2",
        gpt2_model,
        gpt2_optimizer,
        gpt2_loss(ids),
        lambda model: lm_step(model, ids),
        one_device_runs(GPT2_RUNS, one_device),
        steps,
        extra,
    )
    ms = result["median_step_ms"]
    if one_device:
        result["microbatched_over_one"] = {"1dev": ms["jmp_1dev_mb4"] / ms["jmp_1dev_mb1"]}
        result["after_over_before"] = ms["jmp_1dev_mb1"] / ms["jmp_1dev_mb1_before"]
        result["over_handwritten_jax"] = {k: v / ms["handwritten_jax"] for k, v in ms.items() if k.startswith("jmp")}
        result["scanned_over_unscanned"] = ms["jmp_1dev_mb1"] / ms["jmp_1dev_mb1_unscanned"]
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


def measure_steps(steps: int, one_device: bool) -> dict:
    """Both models' step timings in this process: with JAX's one CPU device, or with 8 emulated."""
    if not one_device:
        emulate_devices()
    elif len(jax.devices()) != 1:
        raise SystemExit(f"the one-device timings need a process with one JAX device, not {len(jax.devices())}")
    result = {"devices": len(jax.devices()), "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as inductor_cache:
        # inductor compiles from scratch too: its on-disk caches of an earlier run would make its warm-up a load
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
        result["grouped_net"] = grouped_net(steps, one_device)
        result["gpt2"] = gpt2(steps, one_device)
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    result["load_average_after"] = os.getloadavg()  # the machine is shared: what else ran
    return result


def measured_in_child(steps: int, devices: str) -> dict:
    """``measure_steps`` in a fresh process: the device count is fixed when JAX's backend starts."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        command = [sys.executable, "-m", "benchmarks.step_speed", "--steps", str(steps), "--only", devices]
        subprocess.run([*command, "--out", out.name], env=env, check=True)
        with open(out.name) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/step_speed.json")
    parser.add_argument("--only", choices=["one_device", "eight_devices"], help="measure this part in this process")
    args = parser.parse_args()
    os.environ.setdefault(compilation.ENVIRONMENT, "off")  # first steps here compile; the main job's runs say
    transformers.logging.set_verbosity_error()
    if args.only:
        write_results(args.out, measure_steps(args.steps, one_device=args.only == "one_device"))
        return
    result = {"machine": machine(), "torch_threads": torch.get_num_threads()}
    result["one_device"] = measured_in_child(args.steps, "one_device")
    result["eight_devices"] = measured_in_child(args.steps, "eight_devices")
    result["1dev_emulated_over_alone"] = {
        model: result["eight_devices"][model]["median_step_ms"]["jmp_1dev_mb1"]
        / result["one_device"][model]["median_step_ms"]["jmp_1dev_mb1"]
        for model in ("grouped_net", "gpt2")
    }
    if not args.skip_main_job:
        result["main_job"] = main_job_runs()
    write_results(args.out, result)
    print(json.dumps(result, indent=2))
    for part in ("one_device", "eight_devices"):  # GroupedNet's dropout draws differ between torch and jmp
        losses = result[part]["gpt2"]["first_loss"]
        np.testing.assert_allclose(list(losses.values()), losses["torch_eager"], rtol=1e-3)


if __name__ == "__main__":
    main()
