"""Mixed precision (bf16, fp16) against float32: bytes held per parameter, step temporaries, step time, loss.

    python -m benchmarks.mixed_precision [--steps 10] [--loss-steps 5] [--out benchmarks/results/mixed_precision.json]

GPT-2 (Hugging Face, from a config, random weights) with 4 layers, d_model 256, 4 heads, vocab 512;
batch 8 x sequence 256; no dropout; ``torch.optim.AdamW`` through ``smp.DistributedOptimizer`` (fp16:
dynamic loss scaling from 2**10). Precisions: ``fp32`` (no key), ``bf16`` (``{"bf16": True}``), ``fp16``
(``{"fp16": True}``): float32 master parameters, forward and backward under torch's CUDA autocast rules in
the half dtype, gradients kept in the half dtype, unscaled into float32 by the optimizer's update.

Held bytes per parameter
    ``sharded_data_parallel_degree=8`` on 8 emulated CPU devices, after one step and before
    ``optimizer.step()``: bytes of ``training_state.params``, ``training_state.grads`` and
    ``optimizer.opt_state`` on the fullest device (their ``addressable_shards``), each divided by the
    parameter elements that device holds. Expected: 4 + 4 + 8 = 16 (fp32), 4 + 2 + 8 = 14 (bf16, fp16).

Temporaries, one device
    ``memory_analysis().temp_size_in_bytes`` of the compiled step (forward + backward), with its ratio to
    fp32. Beside it, what the step *asks* to keep, independent of the backend: the values its forward hands
    to its backward (``step.trace(...).jaxpr``: variables defined outside and read inside the
    ``transpose(...)`` part of JAX's name stack), by dtype and shape. And what XLA:CPU makes of it: the
    result types of the optimized program's dots, and of the buffers its entry computation defines.

Step time, one device
    A training iteration (``zero_grad``, step, ``optimizer.step()``) of each precision, interleaved
    (``harness.time_interleaved``, 3 warm-up rounds), medians, with ratios to fp32 (of the medians, and
    the median of per-round ratios).

Loss
    The first ``--loss-steps`` training steps of each precision on the same batch from the same weights,
    with each one's relative difference from fp32.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import time

import jax
import jax.extend
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
    medians,
    shape_bytes,
    time_interleaved,
    token_ids,
    write_results,
)

LAYERS, D_MODEL, HEADS, VOCAB, SEQUENCE, BATCH, LR = 4, 256, 4, 512, 256, 8, 1e-3
FSDP = 8
MIB = 2**20

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}
FP16_SCALING = dict(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10})
# GPT-2's gelu_new is several ops (torch.pow among them, computed in float32 by autocast); the same model
# with the tanh GELU as one op (F.gelu(approximate="tanh")) shows what that costs. Compiled only.
GELU_PROBE = {"activation_function": "gelu_pytorch_tanh"}


def gpt2(**changes) -> torch.nn.Module:
    spec = gpt2_config(vocab=VOCAB, positions=SEQUENCE, d_model=D_MODEL, layers=LAYERS, heads=HEADS)
    return causal_lm({**spec, **changes})


def build(name: str, devices: list, **changes):
    """(model, optimizer) of precision ``name`` on ``devices``, under the config it runs with."""
    config = dict(PRECISIONS[name])
    if len(devices) > 1:
        config["sharded_data_parallel_degree"] = len(devices)
    smp.init(config, devices=devices)
    model = smp.DistributedModel(gpt2(**changes))
    scaling = FP16_SCALING if name == "fp16" else {}
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR), **scaling)
    return model, optimizer


# --- held bytes ---------------------------------------------------------------------------------------------


def _per_device(tree, *, elements: bool = False) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                counts[shard.device] += shard.data.size if elements else shard.data.nbytes
    return counts


def held_per_parameter(name: str, ids: torch.Tensor) -> dict:
    """Bytes per parameter on the fullest device between steps (fsdp over all devices), with the breakdown."""
    model, optimizer = build(name, jax.devices()[:FSDP])
    optimizer.zero_grad()
    lm_step(model, ids)
    training = model.training_state
    parts = {
        "params": _per_device(training.params),
        "grads": _per_device(training.grads),
        "optimizer_state": _per_device(optimizer.opt_state),
    }
    elements = _per_device(training.params, elements=True)
    fullest = max(elements, key=lambda d: sum(p[d] for p in parts.values()))
    per_param = {part: counts[fullest] / elements[fullest] for part, counts in parts.items()}
    optimizer.step()
    return {
        "bytes_per_param": sum(per_param.values()),
        "breakdown": per_param,
        "held_bytes_fullest_device": sum(p[fullest] for p in parts.values()),
        "params_on_fullest_device": elements[fullest],
        "params_total": model.layout.parameter_count(),
        "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(training.grads)}) if training.grads else None,
        "mesh": {k: v for k, v in smp.get_mesh().shape.items() if v > 1},
    }


# --- what the step keeps for its backward, and what XLA:CPU makes of it --------------------------------------


def saved_residuals(jaxpr) -> dict:
    """Bytes the forward hands to the backward (by dtype, and the largest (dtype, shape) groups)."""
    backward_vars = set()
    forward_vars = set()
    for eqn in jaxpr.eqns:
        target = backward_vars if str(eqn.source_info.name_stack).startswith("transpose(") else forward_vars
        target.update(eqn.outvars)
    saved = {
        v
        for eqn in jaxpr.eqns
        if str(eqn.source_info.name_stack).startswith("transpose(")
        for v in eqn.invars
        if not isinstance(v, jax.extend.core.Literal) and v in forward_vars
    }
    by_dtype: collections.Counter = collections.Counter()
    by_shape: collections.Counter = collections.Counter()
    for v in saved:
        size = v.aval.size * v.aval.dtype.itemsize
        by_dtype[str(v.aval.dtype)] += size
        by_shape[f"{v.aval.dtype}{list(v.aval.shape)}"] += size
    return {
        "bytes": sum(by_dtype.values()),
        "by_dtype": dict(by_dtype.most_common()),
        "largest": dict(by_shape.most_common(6)),
    }


def jaxpr_dot_dtypes(jaxpr) -> dict:
    """Result dtypes of the step's dots as JAX hands them to XLA (forward and backward)."""
    dots = collections.Counter(str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general")
    return dict(dots.most_common())


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>.*?)\s(?P<op>[\w-]+)\(")
_NOT_BUFFERS = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant"}


def compiled_dtypes(hlo: str) -> dict:
    """Result dtypes of the optimized program's dots, and bytes its entry computation's buffers hold by dtype.

    The entry bytes are summed over all instructions (not a peak: buffers are reused); they say which
    dtype the materialized arrays of the program are in."""
    dots: collections.Counter = collections.Counter()
    entry: collections.Counter = collections.Counter()
    in_entry = False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            in_entry = False
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        shapes = hlo_shapes(match["type"])
        if match["op"] == "dot" and shapes:
            dots[shapes[0][0]] += 1
        if in_entry and match["op"] not in _NOT_BUFFERS:
            for dtype, dims in shapes:
                entry[dtype] += shape_bytes(dtype, dims)
    return {"dot_result_dtypes": dict(dots), "entry_buffer_bytes_by_dtype": dict(entry.most_common())}


def step_memory(model, ids: torch.Tensor) -> dict:
    compiled = lm_step.lower(model, ids).compile()
    stats = compiled.memory_analysis()
    jaxpr = lm_step.trace(model, ids).jaxpr.jaxpr
    return {
        "temp": stats.temp_size_in_bytes,
        "argument": stats.argument_size_in_bytes,
        "output": stats.output_size_in_bytes,
        "saved_for_backward": saved_residuals(jaxpr),
        "jaxpr_dot_result_dtypes": jaxpr_dot_dtypes(jaxpr),
        "xla_cpu": compiled_dtypes(compiled.as_text()),
    }


# --- training: loss and step time --------------------------------------------------------------------------------


def train_iteration(model, optimizer, ids):
    optimizer.zero_grad()
    loss = lm_step(model, ids).reduce_mean()
    optimizer.step()
    return loss, model.training_state.params


def loss_curve(name: str, model, optimizer, ids, steps: int) -> dict:
    losses, skipped = [], 0
    for _ in range(steps):
        losses.append(float(train_iteration(model, optimizer, ids)[0]))
        skipped += bool(optimizer.overflow) if name == "fp16" else 0
    return {"losses": losses, "skipped_updates": skipped, "loss_scale": optimizer.loss_scale}


# --- output -------------------------------------------------------------------------------------------------------


def table(rows: dict) -> str:
    header = (
        f"{'':<6}{'B/param':>8}{'params':>8}{'grads':>7}{'opt':>6}{'temp MiB':>10}{'ratio':>7}"
        f"{'saved MiB':>11}{'ratio':>7}{'step s':>8}{'ratio':>7}{'loss':>9}{'rel diff':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, r in rows.items():
        b = r["held"]["breakdown"]
        lines.append(
            f"{name:<6}{r['held']['bytes_per_param']:>8.2f}{b['params']:>8.2f}{b['grads']:>7.2f}"
            f"{b['optimizer_state']:>6.2f}{r['memory']['temp'] / MIB:>10.1f}{r['temp_ratio']:>7.2f}"
            f"{r['memory']['saved_for_backward']['bytes'] / MIB:>11.1f}{r['saved_ratio']:>7.2f}"
            f"{r['median_step_seconds']:>8.3f}{r['step_time_ratio']:>7.2f}"
            f"{r['loss']['losses'][-1]:>9.4f}{r['final_loss_rel_diff']:>10.2e}"
        )
    return "\n".join(lines)


def notes(rows: dict, probe: dict) -> list[str]:
    """What the numbers say, from the numbers of this run."""
    bf16, fp16 = rows["bf16"], rows["fp16"]
    half_dots = {name: rows[name]["memory"]["jaxpr_dot_result_dtypes"] for name in ("bf16", "fp16")}
    cpu_dots = {name: rows[name]["memory"]["xla_cpu"]["dot_result_dtypes"] for name in ("bf16", "fp16")}
    saved = bf16["memory"]["saved_for_backward"]["largest"]
    return [
        "held bytes per parameter: params are float32 masters in every precision; bf16/fp16 keep gradients in "
        f"the half dtype: {bf16['held']['bytes_per_param']:.2f} B/param (bf16), "
        f"{fp16['held']['bytes_per_param']:.2f} (fp16) against {rows['fp32']['held']['bytes_per_param']:.2f} "
        "(fp32), measured on the fullest of the 8 fsdp devices (small parameters stay replicated under fsdp, "
        "so that device holds a little more than 1/8 of them; per parameter the figure is exact).",
        f"compiled step temporaries (XLA:CPU): {bf16['temp_ratio']:.2f}x fp32 (bf16), {fp16['temp_ratio']:.2f}x "
        "(fp16); target <= 0.6x: "
        + ("met" if max(bf16["temp_ratio"], fp16["temp_ratio"]) <= 0.6 else "not quite met on XLA:CPU")
        + f". XLA:CPU computes every dot in float32: the jaxpr's dots give {half_dots['bf16']} (bf16) / "
        f"{half_dots['fp16']} (fp16) results, the optimized CPU programs {cpu_dots['bf16']} / {cpu_dots['fp16']}; "
        "matmul outputs are materialized in float32 and converted, so a CPU program holds float32 buffers a GPU "
        "one does not (entry_buffer_bytes_by_dtype).",
        "what the step keeps for the backward (backend-independent, from the jaxpr): "
        f"{bf16['saved_ratio']:.2f}x fp32 (bf16), {fp16['saved_ratio']:.2f}x (fp16). Ops autocast computes in "
        "float32 (softmax, layer_norm, torch.pow in GPT-2's gelu_new) hand half-precision results back and run "
        "under jax.checkpoint, as does attention, so no float32 internals are held between the passes "
        f"(jmp/torch_bridge/autocast.py, half_results). Largest saved groups in bf16: {saved}.",
        "gelu_probe: the same model with activation_function='gelu_pytorch_tanh' (one F.gelu op): saved for "
        f"backward {probe['saved_ratio_bf16']:.2f}x fp32 (bf16), temp {probe['temp_ratio_bf16']:.2f}x on XLA:CPU.",
        f"step time on CPU: bf16 {bf16['step_time_ratio']:.2f}x, fp16 {fp16['step_time_ratio']:.2f}x fp32 "
        f"(median of paired per-round ratios: {bf16['paired_step_time_ratio']:.2f}x, "
        f"{fp16['paired_step_time_ratio']:.2f}x). XLA:CPU converts half-precision ops to float32, so half "
        "precision is no faster here (conversions added); says nothing about a GPU. 2-core machine shared "
        "with other jobs: expect noise of the order of 10%.",
        f"loss after {len(bf16['loss']['losses'])} steps agrees with fp32 to {bf16['final_loss_rel_diff']:.1e} "
        f"(bf16) and {fp16['final_loss_rel_diff']:.1e} (fp16) relative; fp16 skipped "
        f"{fp16['loss']['skipped_updates']} updates, loss scale {fp16['loss']['loss_scale']:g}.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--loss-steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/mixed_precision.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    emulate_devices()
    start = time.perf_counter()
    ids = token_ids(BATCH, SEQUENCE, VOCAB)
    one = jax.devices()[:1]

    held = {name: held_per_parameter(name, ids) for name in PRECISIONS}
    print(f"held bytes measured ({time.perf_counter() - start:.0f}s)", flush=True)

    models, memory, losses = {}, {}, {}
    for name in PRECISIONS:
        model, optimizer = build(name, one)
        memory[name] = step_memory(model, ids)
        losses[name] = loss_curve(name, model, optimizer, ids, args.loss_steps)
        models[name] = (model, optimizer)
    print(f"memory and losses measured ({time.perf_counter() - start:.0f}s)", flush=True)

    runs = {name: functools.partial(train_iteration, *pair, ids) for name, pair in models.items()}
    prepare = {name: functools.partial(smp.init, PRECISIONS[name], devices=one) for name in PRECISIONS}
    samples = time_interleaved(runs, args.steps, warmup=3, prepare=prepare)
    median = medians(samples)
    del models
    print(f"step times measured ({time.perf_counter() - start:.0f}s)", flush=True)

    probe_memory = {name: step_memory(build(name, one, **GELU_PROBE)[0], ids) for name in ("fp32", "bf16")}
    probe = {name: {k: m[k] for k in ("temp", "saved_for_backward", "xla_cpu")} for name, m in probe_memory.items()}
    probe["temp_ratio_bf16"] = probe["bf16"]["temp"] / probe["fp32"]["temp"]
    probe["saved_ratio_bf16"] = (
        probe["bf16"]["saved_for_backward"]["bytes"] / probe["fp32"]["saved_for_backward"]["bytes"]
    )

    rows = {}
    for name in PRECISIONS:
        final, reference = losses[name]["losses"][-1], losses["fp32"]["losses"][-1]
        saved, saved_fp32 = memory[name]["saved_for_backward"]["bytes"], memory["fp32"]["saved_for_backward"]["bytes"]
        rows[name] = {
            "held": held[name],
            "memory": memory[name],
            "temp_ratio": memory[name]["temp"] / memory["fp32"]["temp"],
            "saved_ratio": saved / saved_fp32,
            "median_step_seconds": median[name],
            "step_time_ratio": median[name] / median["fp32"],
            "paired_step_time_ratio": statistics.median(t / t32 for t, t32 in zip(samples[name], samples["fp32"])),
            "step_seconds": samples[name],
            "loss": losses[name],
            "final_loss_rel_diff": abs(final - reference) / abs(reference),
        }
    seconds = time.perf_counter() - start

    print()
    print(table(rows))
    print(
        f"\ngelu_pytorch_tanh probe, bf16 / fp32: temp {probe['temp_ratio_bf16']:.2f}, "
        f"saved for backward {probe['saved_ratio_bf16']:.2f}"
    )
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**machine(), "transformers": transformers.__version__},
        "config": dict(
            layers=LAYERS,
            d_model=D_MODEL,
            heads=HEADS,
            vocab=VOCAB,
            sequence=SEQUENCE,
            batch=BATCH,
            optimizer="AdamW",
            lr=LR,
            fp16_scaling=FP16_SCALING,
            held_bytes_mesh=f"fsdp={FSDP}",
            memory_and_time_devices=1,
            timed_rounds=args.steps,
            warmup_rounds=3,
            loss_steps=args.loss_steps,
        ),  # fmt: skip
        "notes": notes(rows, probe),
        "precisions": rows,
        "gelu_probe": probe,
        "seconds": seconds,
    }
    write_results(args.out, result)
    print(f"\nwrote {args.out} ({seconds:.0f}s)")


if __name__ == "__main__":
    main()
