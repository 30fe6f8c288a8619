"""Data parallelism under microbatches: gradients reduced once per step (after the microbatch loop) against once per
microbatch (inside it, as GSPMD placed them before ``jmp.compiled_step.replica_gradients``).

    python -m benchmarks.gradient_reduction [--steps 10] [--out benchmarks/results/gradient_reduction.json]

Two models at 8-way data parallelism (``ddp``), each with 1 microbatch, 4 microbatches reduced once per step, and 4
microbatches reduced per microbatch (the replica copies turned off while the step compiles), side by side in one
process (medians of interleaved training iterations after warm-up): the seed's GroupedNet (batch 64, Adadelta) and
the GPT-2 of ``step_speed`` (4 layers, d_model 256, AdamW) on 32 rows of 32 tokens, with its layers run one by one
and as one scan over weights stored stacked (``scan_layers``); and GroupedNet in two pipeline stages over 4-way data
parallelism (pp2 x dp4, 1F1B), whose per-replica gradients go through the schedule's loop. For each compiled step:
the bytes the all-reduces inside loops move (the microbatch loop's or the schedule's body with the computations it
calls, per execution; a layer scan's too; over data-parallel groups and any other) and after them, and the
temporaries per device (``memory_analysis``). The gradients of the two 4-microbatch forms are compared after the first
step (they differ by float summation order only).

What fewer rows per call cost without any reduction (``torch_one_replica``): one data-parallel replica's share of the
same step in PyTorch eager on one thread (a device's share of this machine's cores), forward and backward of its rows
in 1 call against 4 calls of a quarter each, gradients accumulated as under DDP's ``no_sync``; its ratio is the
compute granularity a 4-microbatch step pays wherever its gradients are reduced.

On this CPU a collective is a memory copy between emulated devices, so the times show the loop's extra work, not a
network's; the bytes are what a cluster would move.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import jmp as smp
from benchmarks import step_speed
from benchmarks.harness import (
    all_reduce_bytes,
    emulate_devices,
    lm_step,
    machine,
    medians,
    named_grads,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.compiled_step import replica_gradients
from jmp.runtime import compilation_cache as compilation

GPT2_BATCH, GPT2_SEQUENCE = 32, 32  # 4 microbatches of a row per data-parallel device; step_speed's 1,024 tokens
RUNS = {  # name after the layout's -> (microbatches, gradients kept per replica through the loop)
    "mb1": (1, True),
    "mb4_reduced_once": (4, True),
    "mb4_reduced_per_microbatch": (4, False),
}
PIPELINE = {"partitions": 2, "pipeline": "interleaved", "auto_partition": True}  # pp2 x dp4


SCANNED = {"scan_layers": True}  # the layers as one scan over weights stored stacked


@contextlib.contextmanager
def replica_copies(enabled: bool):
    """Steps compiled meanwhile keep gradients per replica (the default) or reduce them where they are made."""
    original = replica_gradients.replicated_axes
    if not enabled:
        replica_gradients.replicated_axes = lambda model, signature: ()
    try:
        yield
    finally:
        replica_gradients.replicated_axes = original


def _initialiser(config: dict):
    return lambda: step_speed.init(config, None)


def measure(name, make_model, make_optimizer, step, args_of, steps, extra_config=None, layout="dp8"):
    runs, compiled, grads, configs = {}, {}, {}, {}
    for suffix, (microbatches, once) in RUNS.items():
        run = f"{layout}_{suffix}"
        config = configs[run] = {"microbatches": microbatches, "ddp": True, **(extra_config or {})}
        with replica_copies(once):
            step_speed.init(config, None)
            probe = smp.DistributedModel(make_model())
            program = step.lower(probe, *args_of()).compile()
            runs[run], _ = step_speed.jmp_run(make_model, make_optimizer, config, None, lambda m: step(m, *args_of()))
        analysis = program.memory_analysis()
        compiled[run] = {
            "all_reduce_bytes": all_reduce_bytes(program.as_text()),
            "temporaries_mib": analysis.temp_size_in_bytes / 2**20 if analysis else None,
        }
        if microbatches > 1:  # the gradients of one step from the same weights
            step_speed.init(config, None)
            with replica_copies(once):
                model = smp.DistributedModel(make_model())
                step(model, *args_of())
            grads[run] = named_grads(model.grads)
        print(f"{name} {run}: {json.dumps(compiled[run])}", flush=True)
    prepare = {run: _initialiser(config) for run, config in configs.items()}
    median = medians(time_interleaved(runs, steps, warmup=3, prepare=prepare))
    ms = {k: v * 1e3 for k, v in median.items()}
    print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), flush=True)
    once, per = grads[f"{layout}_mb4_reduced_once"], grads[f"{layout}_mb4_reduced_per_microbatch"]
    return {
        "median_step_ms": ms,
        "mb4_over_mb1": {
            "reduced_once": ms[f"{layout}_mb4_reduced_once"] / ms[f"{layout}_mb1"],
            "reduced_per_microbatch": ms[f"{layout}_mb4_reduced_per_microbatch"] / ms[f"{layout}_mb1"],
        },
        "compiled": compiled,
        "largest_gradient_difference": max(float(np.abs(once[k] - per[k]).max()) for k in once),
        "largest_gradient": max(float(np.abs(per[k]).max()) for k in per),
    }


def torch_one_replica(model: torch.nn.Module, loss_of, rows: tuple[torch.Tensor, ...], steps: int) -> dict:
    """Seconds of one replica's rows through forward and backward in PyTorch eager on one thread: 1 call of all
    rows against 4 calls of a quarter each (gradients accumulating); medians of interleaved rounds after warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    quarter = rows[0].shape[0] // 4

    def run(pieces):
        def call():
            model.zero_grad(set_to_none=True)
            for piece in pieces:
                loss_of(model, *piece).backward()

        return call

    runs = {
        "mb1": run([rows]),
        "mb4": run([tuple(t[i * quarter : (i + 1) * quarter] for t in rows) for i in range(4)]),
    }
    try:
        samples = time_interleaved(runs, steps, warmup=3)
    finally:
        torch.set_num_threads(threads)
    ms = {name: v * 1e3 for name, v in medians(samples).items()}
    return {"rows": rows[0].shape[0], "median_ms": ms, "mb4_over_mb1": ms["mb4"] / ms["mb1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/gradient_reduction.json")
    args = parser.parse_args()
    os.environ.setdefault(compilation.ENVIRONMENT, "off")
    transformers.logging.set_verbosity_error()
    emulate_devices()
    images, labels = step_speed.grouped_net_data()

    def grouped_net():
        torch.manual_seed(0)
        return step_speed.GroupedNet().eval()  # no dropout: both forms draw the same numbers

    result = {"machine": machine(), "load_average_at_start": os.getloadavg()}
    for key, name, config, layout in (
        ("grouped_net", "GroupedNet", None, "dp8"),
        ("grouped_net_pp2_dp4", "GroupedNet in two pipeline stages", PIPELINE, "pp2_dp4"),
    ):
        result[key] = measure(
            name,
            grouped_net,
            lambda params: torch.optim.Adadelta(params, lr=4.0),
            step_speed.grouped_net_step,
            lambda: (images, labels),
            args.steps,
            config,
            layout,
        )
    result["grouped_net"]["torch_one_replica"] = torch_one_replica(
        grouped_net(), lambda model, x, y: F.nll_loss(model(x), y), (images[:8], labels[:8]), args.steps
    )
    ids = token_ids(GPT2_BATCH, GPT2_SEQUENCE, step_speed.GPT2["vocab"])
    for key, name, config in (
        ("gpt2", "GPT-2", {"scan_layers": False}),
        ("gpt2_scan_layers", "GPT-2 under scan_layers", SCANNED),
    ):
        result[key] = measure(
            name,
            step_speed.gpt2_model,
            step_speed.gpt2_optimizer,
            lm_step,
            lambda: (ids,),
            args.steps,
            config,
        )
    result["gpt2"]["torch_one_replica"] = torch_one_replica(
        step_speed.gpt2_model(),
        lambda model, x: model(input_ids=x, labels=x, use_cache=False).loss,
        (ids[:4],),
        args.steps,
    )
    result["load_average_at_end"] = os.getloadavg()
    write_results(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
