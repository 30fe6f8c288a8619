"""The embedding's output laid out as the batch under sharded data parallelism: communication, memory and step time
with and without it, side by side in one run.

    python -m benchmarks.embedding_layout [--hidden 256] [--layers 4] [--batch 32] [--length 256] [--steps 5]
        [--out benchmarks/results/embedding_layout.json]

A Llama (``--layers`` layers of width ``--hidden``, 8 query and 4 key/value heads, vocabulary 128) on ``--batch``
rows of ``--length`` tokens, one forward and backward (``lm_step``) on 8 emulated CPU devices, at fsdp8, fsdp4 x
dp2, tp2 x fsdp4 and tp2 x fsdp2. Each layout is built twice: as jmp builds it (``sharding.embedding_outputs``
lays an fsdp-split embedding's output out as the batch) and without that hook (``before``), which is how jmp
compiled the step until it was added. Read from each compiled step: the all-gathers whose result is the whole
batch's activations ``[batch, length, ...]``, every collective at its logical size (all-gather: its result;
all-reduce, all-to-all, collective-permute: their result; reduce-scatter: its operand), ``memory_analysis()``'s
temporaries per device, the loss and the largest per-tensor relative difference of the gradients against PyTorch
on the same weights and batch; and the median step time of ``--steps`` steps, the two builds interleaved. The
emulated devices share this machine's cores, so the time says what the partitioned program costs in total (a
collective is a copy here), not a cluster's speed.
"""

from __future__ import annotations

import argparse
import functools
import re
from unittest import mock

import numpy as np

import jmp as smp
from benchmarks.context_parallel import collective_bytes
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    llama_config,
    lm_step,
    machine,
    medians,
    named_grads,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.wrapped_model.distributed_model import DistributedModel

LAYOUTS = {
    "fsdp8": {"sharded_data_parallel_degree": 8},
    "fsdp4xdp2": {"sharded_data_parallel_degree": 4},
    "tp2xfsdp4": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4},
    "tp2xfsdp2": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
}
VOCAB = 128


def gradient_error(model, reference) -> float:
    grads = named_grads(model.grads)
    return max(
        float(np.linalg.norm(grads[name] - p.grad.numpy()) / max(np.linalg.norm(p.grad.numpy()), 1e-12))
        for name, p in reference.named_parameters()
    )


def built_as(hooked: bool):
    """The context a build traces in: as jmp builds it, or without the embedding hook."""
    return mock.patch.object(
        DistributedModel, "_embedding_hooks", DistributedModel._embedding_hooks if hooked else dict
    )


def run_as(model, ids, hooked: bool):
    with built_as(hooked):  # should the step trace again, it traces as it was built
        return lm_step(model, ids).outputs


def build(spec: dict, layout: str, ids, hooked: bool) -> tuple[dict, object]:
    smp.init(LAYOUTS[layout])
    model = smp.DistributedModel(causal_lm(spec))
    with built_as(hooked):
        compiled = lm_step.lower(model, ids).compile()
        loss = float(lm_step(model, ids).reduce_mean().detach())  # traced (and compiled) here, under the same build
    hlo = compiled.as_text()
    whole = rf"= \w+\[{ids.shape[0]},{ids.shape[1]},[\d,]*\]\S* all-gather(?:-start)?\("
    return {
        "whole_batch_all_gathers": len(re.findall(whole, hlo)),
        "collective_kib": {k: round(v / 1024) for k, v in collective_bytes(hlo).items()},
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "loss": loss,
    }, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/embedding_layout.json")
    args = parser.parse_args()
    emulate_devices(8)
    spec = llama_config(
        vocab=VOCAB, positions=args.length, hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers,
        heads=8, kv_heads=4,
    )  # fmt: skip
    ids = token_ids(args.batch, args.length, VOCAB)
    reference = causal_lm(spec)
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    result: dict = {"machine": machine(), "model": spec, "batch": [args.batch, args.length], "layouts": {}}
    for layout in LAYOUTS:
        rows, models = {}, {}
        for name, hooked in (("before", False), ("now", True)):
            rows[name], models[name] = build(spec, layout, ids, hooked)
            rows[name]["loss_relative_difference"] = abs(rows[name]["loss"] - expected.item()) / expected.item()
            rows[name]["largest_gradient_relative_difference"] = gradient_error(models[name], reference)
        runs = {name: functools.partial(run_as, model, ids, name == "now") for name, model in models.items()}
        init = functools.partial(smp.init, LAYOUTS[layout])
        times = medians(time_interleaved(runs, steps=args.steps, prepare=dict.fromkeys(runs, init)))
        for name in rows:
            rows[name]["step_ms"] = times[name] * 1000
        result["layouts"][layout] = rows
        before, now = rows["before"], rows["now"]
        print(
            f"{layout:10s} whole-batch all-gathers {before['whole_batch_all_gathers']:3d} -> "
            f"{now['whole_batch_all_gathers']:3d}, "
            f"collective KiB {sum(before['collective_kib'].values()):8d} -> {sum(now['collective_kib'].values()):8d}, "
            f"temp {before['temp_mib']:.1f} -> {now['temp_mib']:.1f} MiB, step {before['step_ms']:.0f} -> "
            f"{now['step_ms']:.0f} ms (x{now['step_ms'] / before['step_ms']:.2f}), gradients rel <= "
            f"{max(before['largest_gradient_relative_difference'], now['largest_gradient_relative_difference']):.1e}",
            flush=True,
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
