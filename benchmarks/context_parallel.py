"""Context parallelism (``context_parallel_degree``): correctness against PyTorch, and memory, communication and
step time per device against the sequence length and the degree.

    python -m benchmarks.context_parallel [--lengths 1024 2048 4096] [--degrees 1 2 4] [--timed-up-to 2048]
        [--timed-steps 9] [--work-length 1024] [--skip-correctness] [--pipeline-lengths 4096]
        [--out benchmarks/results/context_parallel.json]

Correctness: the model x layout pairs the suite leaves out (``tests/sharding/test_context_parallel.py`` runs
Llama at cp 2 x fsdp 2 x tp 2): GPT-2 and Llama (grouped-query attention) at cp 2 and cp 4 on 8 emulated
devices, and GPT-2 at cp 2 x fsdp 2 x tp 2, each with the ring and with the all-gather form of attention,
one step on four rows of 16 tokens (two right-padded) against
PyTorch on the whole sequences: the loss's relative difference and the largest per-tensor relative difference of
the gradients (``||g - g_torch|| / ||g_torch||``). In a pipeline (Llama at pp 2 x cp 2 x tp 2 and pp 2 x cp 4,
GPT-2 at pp 2 x cp 2 x fsdp 2, Mixtral at pp 2 x cp 2 x ep 2; the suite's --slow tier runs Llama at pp 2 x cp 2 x
dp 2): eight rows (three right-padded) in 2 microbatches, against PyTorch on the same microbatches
(``microbatch_rows``), the mean of their losses.

Pipeline memory (``--pipeline-lengths``): ``PIPELINE_MODEL`` (``MEMORY_MODEL`` with 4 layers) in 2 stages at
cp 1, 2 and 4 (2, 4 and 8 devices), two rows in 2 microbatches: the compiled temporaries per device and the
collectives (inside a stage the ring passes its blocks with all-to-alls).

Memory and communication: a Llama (2 layers, hidden 64, 4 heads, 2 key/value heads, vocabulary 256) on one row of
``length`` tokens, at cp = ``degree`` on ``degree`` devices (no other parallelism, so every figure is per device
and cp 1 is the whole step on one device). The step is compiled, not run: ``memory_analysis()``'s temporaries
(activations, attention scores, gradients in flight), their ratio to cp 1's, and the collectives of the optimized
HLO at their logical size (all-gather: the result; all-reduce / collective-permute: the result; reduce-scatter:
the operand), each instruction once (the ring's loop is unrolled). Both forms of attention over the split
sequence: the ring (``jmp.torch_bridge.lowering.ring_attention``, the default) and "all_gather"
(``JMP_CONTEXT_PARALLEL_ATTENTION=all_gather``: XLA's partitioner gathers each layer's keys and values). The
ring's ideal is listed beside them: each device receives the other cp - 1 blocks of every layer's keys and
values once forward, and as much of their gradients backward (bytes of the per-device buffers). The all-reduce of the
parameters' gradients over cp (each device's tokens give part of every gradient) is in ``collective_bytes``
but not in the printed line.

The forms of attention over the split sequence are three: the ring in the load-balanced order (``ring``, the
default), the ring in natural order (``ring_natural``) and ``all_gather``. Hugging Face's Llama passes the causal
pattern as a mask with ``is_causal=False``: the balanced ring finds it below the diagonal as the program runs and
skips the blocks above it; in natural order such a mask has every block computed.

Work per device (``--work-length`` tokens, one head of causal attention at each degree): the query x key scores
each device computes at each ring step, in the balanced and the natural order, from the plan
``ring_attention.computed_scores``; the totals per device are counted as the program runs (a callback in every
block visit) and must equal the plan's; with the causal pattern as a mask (as Hugging Face passes it) they are
counted too: the balanced order computes the same, the natural order every block in full. A ring step
lasts as long as its busiest device: ``critical_path_scores`` is the sum over steps of the most any device
computes, and its ratio balanced / natural is what the balanced order saves on devices that compute in parallel.

Step time: the median of ``--timed-steps`` steps (after 2 untimed), the three forms of one length and degree
interleaved (round by round, in alternating order), for lengths up to ``--timed-up-to``; ratios to the natural
ring's. The emulated devices share this machine's cores, so a cp run's devices do not compute in parallel as GPUs
would: the time says what the partitioned program costs in total (fewer scores computed, more bytes moved), not
the speed-up of a cluster, which the critical path above measures.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import AxisType

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    hlo_shapes,
    llama_config,
    machine,
    medians,
    named_grads,
    shape_bytes,
    time_interleaved,
    write_results,
)
from jmp.torch_bridge.lowering import ring_attention
from jmp.torch_bridge.lowering.ring_attention import ENVIRONMENT_VARIABLE, FORMS

LAYOUTS = {
    "cp2": {"context_parallel_degree": 2},
    "cp4": {"context_parallel_degree": 4},
    "cp2xfsdp2xtp2": {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2},
    "pp2xcp2xtp2": {
        "pipeline_parallel_degree": 2,
        "microbatches": 2,
        "context_parallel_degree": 2,
        "tensor_parallel_degree": 2,
    },
    "pp2xcp4": {"pipeline_parallel_degree": 2, "microbatches": 2, "context_parallel_degree": 4},
    "pp2xcp2xep2": {
        "pipeline_parallel_degree": 2,
        "microbatches": 2,
        "context_parallel_degree": 2,
        "expert_parallel_degree": 2,
    },
    "pp2xcp2xfsdp2": {
        "pipeline_parallel_degree": 2,
        "microbatches": 2,
        "context_parallel_degree": 2,
        "sharded_data_parallel_degree": 2,
    },
}
CHECKED = [("gpt2", "cp2"), ("gpt2", "cp4"), ("llama", "cp2"), ("llama", "cp4"), ("gpt2", "cp2xfsdp2xtp2")]
CHECKED += [("llama", "pp2xcp2xtp2"), ("llama", "pp2xcp4"), ("gpt2", "pp2xcp2xfsdp2"), ("mixtral", "pp2xcp2xep2")]
SMALL_VOCAB = 128
MEMORY_MODEL = llama_config(vocab=256, positions=16384, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
PIPELINE_MODEL = {**MEMORY_MODEL, "num_hidden_layers": 4}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@smp.step
def lm_step(model, input_ids, attention_mask, labels):
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
    model.backward(out.loss)
    return out.loss


# --- correctness ----------------------------------------------------------------------------------------------------


def small_lm(name: str) -> torch.nn.Module:
    """The suite's small models (tests/sharding/models.py): GPT-2 with 4 heads, Llama with 8 query and 4 kv heads,
    Mixtral (Llama's attention, 4 experts, top 2)."""
    common = dict(vocab_size=SMALL_VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if name == "gpt2":
        spec = dict(kind="GPT2Config", n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0)
        spec.update(embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        kind = "MixtralConfig" if name == "mixtral" else "LlamaConfig"
        spec = dict(kind=kind, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        spec.update(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
        if name == "mixtral":
            spec.update(num_local_experts=4, num_experts_per_tok=2)
    return causal_lm({**spec, **common})


def padded_batch(rows: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if rows > 2:
        mask[1, length * 2 // 3 :] = 0
        mask[2, length // 3 :] = 0
    if rows > 6:
        mask[6, length // 5 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def microbatch_rows(rows: int, mesh: dict[str, int], microbatches: int) -> list[list[int]]:
    """The batch rows of each microbatch: under SMP each data-parallel rank splits its own rows into microbatches,
    so microbatch m takes the m-th run of rows of every data shard."""
    shards = mesh["dp"] * mesh["fsdp"] * mesh["ep"]
    per_shard = rows // shards
    run = per_shard // microbatches
    return [[d * per_shard + m * run + j for d in range(shards) for j in range(run)] for m in range(microbatches)]


def check_against_pytorch(name: str, layout: str) -> dict:
    """One step at ``layout`` against PyTorch on the same microbatches (the whole batch without a pipeline): the
    mean of the microbatches' losses, and its gradients."""
    smp.init(LAYOUTS[layout])
    rows = 8 if "microbatches" in LAYOUTS[layout] else 4
    batch = padded_batch(rows, 16, SMALL_VOCAB)
    reference = small_lm(name)
    pieces = microbatch_rows(rows, dict(smp.get_mesh().shape), LAYOUTS[layout].get("microbatches", 1))
    expected = sum(reference(**{k: v[r] for k, v in batch.items()}, use_cache=False).loss for r in pieces)
    expected = expected / len(pieces)
    expected.backward()
    model = smp.DistributedModel(small_lm(name))
    loss = float(lm_step(model, **batch).reduce_mean())
    grads = named_grads(model.grads)
    errors = {
        key: float(np.linalg.norm(grads[key] - p.grad.numpy()) / max(np.linalg.norm(p.grad.numpy()), 1e-12))
        for key, p in reference.named_parameters()
    }
    worst = max(errors, key=errors.get)
    return {
        "mesh": dict(smp.get_mesh().shape),
        "loss": loss,
        "torch_loss": expected.item(),
        "loss_relative_difference": abs(loss - expected.item()) / abs(expected.item()),
        "largest_gradient_relative_difference": errors[worst],
        "at": worst,
        "gradients_compared": len(errors),
    }


# --- memory, communication, time ------------------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>.*?)\s(?P<op>[\w-]+?)(?:-start)?\((?P<operands>.*)$")


def collective_bytes(hlo: str) -> dict[str, int]:
    """Logical bytes of each collective kind in the optimized HLO (async -start forms counted once)."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None or match["op"] not in COLLECTIVES or "-done(" in line:
            continue
        shapes = hlo_shapes(match["operands"] if match["op"] == "reduce-scatter" else match["type"])
        if match["op"] != "reduce-scatter" and "-start(" in line and len(shapes) > 1:
            shapes = shapes[len(shapes) // 2 :]  # an async start's type is (operands, results)
        totals[match["op"]] += sum(shape_bytes(dtype, dims) for dtype, dims in shapes)
    return {k: v for k, v in totals.items() if v}


def ring_ideal_bytes(length: int, degree: int) -> int:
    """The least a ring moves into one device per step: the other (cp - 1) / cp of each layer's keys and values
    once forward, and as much of their gradients sent back (float32, the HLO's per-device buffers). Hugging Face's
    Llama repeats its key/value heads to the query heads before ``F.scaled_dot_product_attention``, so the keys
    and values attention receives have ``num_attention_heads`` heads: that is what a ring passes here."""
    spec = MEMORY_MODEL
    kv = 2 * length * spec["num_attention_heads"] * (spec["hidden_size"] // spec["num_attention_heads"]) * 4
    return int(spec["num_hidden_layers"] * 2 * kv * (degree - 1) / degree)


def build(length: int, degree: int, form: str) -> tuple[dict, object, dict]:
    """The step of ``MEMORY_MODEL`` on one row of ``length`` tokens at cp = ``degree``, compiled under ``form``:
    its memory and collectives, the model and the batch."""
    os.environ[ENVIRONMENT_VARIABLE] = form
    smp.init({"context_parallel_degree": degree} if degree > 1 else {}, devices=jax.devices()[:degree])
    model = smp.DistributedModel(causal_lm(MEMORY_MODEL))
    batch = padded_batch(1, length, MEMORY_MODEL["vocab_size"])
    compiled = lm_step.lower(model, **batch).compile()
    stats = compiled.memory_analysis()
    row = {
        "temp_bytes": stats.temp_size_in_bytes,
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "collective_bytes": collective_bytes(compiled.as_text()),
        "ring_ideal_bytes": ring_ideal_bytes(length, degree),
    }
    return row, model, batch


def build_pipelined(length: int, degree: int) -> dict:
    """``PIPELINE_MODEL``'s step in a pipeline of 2 stages at cp = ``degree`` (2 x ``degree`` devices), two rows of
    ``length`` tokens in 2 microbatches, compiled under the default form: memory and collectives per device."""
    os.environ[ENVIRONMENT_VARIABLE] = "ring"
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    if degree > 1:
        config["context_parallel_degree"] = degree
    smp.init(config, devices=jax.devices()[: 2 * degree])
    model = smp.DistributedModel(causal_lm(PIPELINE_MODEL))
    compiled = lm_step.lower(model, **padded_batch(2, length, PIPELINE_MODEL["vocab_size"])).compile()
    stats = compiled.memory_analysis()
    return {
        "temp_bytes": stats.temp_size_in_bytes,
        "argument_bytes": stats.argument_size_in_bytes,
        "collective_bytes": collective_bytes(compiled.as_text()),
    }


def time_forms(degree: int, built: dict[str, tuple], steps: int) -> dict[str, float]:
    """Median step seconds of each form's step, the forms interleaved round by round."""

    def prepare(form):
        def init():
            os.environ[ENVIRONMENT_VARIABLE] = form
            smp.init({"context_parallel_degree": degree} if degree > 1 else {}, devices=jax.devices()[:degree])

        return init

    runs = {form: (lambda m=model, b=batch: lm_step(m, **b).outputs) for form, (_, model, batch) in built.items()}
    return medians(time_interleaved(runs, steps=steps, warmup=2, prepare={form: prepare(form) for form in built}))


# --- work per device --------------------------------------------------------------------------------------------


def counted_scores(length: int, degree: int, *, balanced: bool, causal_as_mask: bool) -> list[int]:
    """Scores each device computes in one causal attention over ``length`` tokens at cp = ``degree`` (one batch row,
    one head), counted as the program runs: a callback in every block visit."""
    mesh = jax.make_mesh((degree,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:degree])
    counted = [0] * degree
    absorb = ring_attention._absorb

    def counting_absorb(state, grouped_q, k, v, allowed, scale):
        scores = grouped_q.shape[1] * k.shape[1]

        def add(me):
            counted[int(me)] += scores

        jax.debug.callback(add, jax.lax.axis_index("cp"))
        return absorb(state, grouped_q, k, v, allowed, scale)

    q = k = v = jnp.ones((1, length, 1, 8), jnp.float32)
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None] if causal_as_mask else None

    def attention(q, k, v):
        return ring_attention.ring_attention(
            q, k, v, mask, mesh=mesh, axis_name="cp", is_causal=not causal_as_mask, scale=1.0, balanced=balanced
        )

    with mock.patch.object(ring_attention, "_absorb", counting_absorb):
        jax.block_until_ready(jax.jit(attention)(q, k, v))
    return counted


def work_per_device(length: int, degree: int) -> dict:
    block = length // degree
    result: dict = {}
    for order, balanced in (("balanced", True), ("natural", False)):
        steps = [
            [
                ring_attention.computed_scores(me, (me - s) % degree, degree, block, balanced=balanced)
                for me in range(degree)
            ]
            for s in range(degree)
        ]
        totals = [sum(step[me] for step in steps) for me in range(degree)]
        counted = counted_scores(length, degree, balanced=balanced, causal_as_mask=False)
        assert counted == totals, f"{order}: the program computed {counted} scores per device, the plan {totals}"
        result[order] = {
            "scores_per_step_per_device": steps,
            "scores_per_device": counted,
            "critical_path_scores": sum(max(step) for step in steps),
            "causal_as_mask_scores_per_device": counted_scores(length, degree, balanced=balanced, causal_as_mask=True),
        }
    result["critical_path_ratio_balanced_to_natural"] = (
        result["balanced"]["critical_path_scores"] / result["natural"]["critical_path_scores"]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timed-up-to", type=int, default=2048)
    parser.add_argument("--timed-steps", type=int, default=9)
    parser.add_argument("--work-length", type=int, default=1024)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--pipeline-lengths", type=int, nargs="*", default=[4096])
    parser.add_argument("--out", default="benchmarks/results/context_parallel.json")
    args = parser.parse_args()
    emulate_devices(8)
    result: dict = {"machine": machine(), "model": MEMORY_MODEL, "correctness": {}, "work": {}, "memory": {}}
    if not args.skip_correctness:
        for (name, layout), form in itertools.product(CHECKED, FORMS):
            os.environ[ENVIRONMENT_VARIABLE] = form
            result["correctness"][f"{name}-{layout}-{form}"] = check = check_against_pytorch(name, layout)
            print(
                f"{name:6s} {layout:14s} {form:10s} loss rel {check['loss_relative_difference']:.1e}  "
                f"gradients rel <= {check['largest_gradient_relative_difference']:.1e} ({check['at']})",
                flush=True,
            )
    for degree in (d for d in args.degrees if d > 1):
        work = result["work"][f"cp{degree}"] = work_per_device(args.work_length, degree)
        for order in ("balanced", "natural"):
            print(
                f"work cp{degree} {order:8s}: scores per device {work[order]['scores_per_device']}, per ring step "
                f"{work[order]['scores_per_step_per_device']}, critical path {work[order]['critical_path_scores']}",
                flush=True,
            )
        print(
            f"work cp{degree}: critical path balanced / natural {work['critical_path_ratio_balanced_to_natural']:.3f}"
        )
    for length in args.lengths:
        rows = result["memory"][str(length)] = {}
        for degree in args.degrees:
            forms = FORMS if degree > 1 else ("none",)
            built = {form: build(length, degree, form) for form in forms}
            if length <= args.timed_up_to:
                for form, seconds in time_forms(degree, built, args.timed_steps).items():
                    built[form][0]["step_seconds"] = seconds
            for form in forms:
                name = f"cp{degree}" + (f"-{form}" if degree > 1 else "")
                rows[name] = row = built[form][0]
                row["temp_ratio_to_cp1"] = row["temp_bytes"] / rows["cp1"]["temp_bytes"] if "cp1" in rows else None
                natural = built["ring_natural"][0].get("step_seconds") if degree > 1 else None
                if natural and "step_seconds" in row:
                    row["step_ratio_to_ring_natural"] = row["step_seconds"] / natural
                moved = row["collective_bytes"].get("collective-permute", 0) + row["collective_bytes"].get(
                    "all-gather", 0
                )
                seconds = row.get("step_seconds", float("nan"))
                print(
                    f"length {length:6d} {name:17s}: temp {row['temp_bytes'] / 2**20:8.1f} MiB"
                    f" (x{row['temp_ratio_to_cp1'] or 1:.2f} of cp1), permute + all-gather {moved / 2**20:7.2f} MiB"
                    f" (ring ideal {row['ring_ideal_bytes'] / 2**20:.2f}), step {seconds:.3f} s"
                    f" (x{row.get('step_ratio_to_ring_natural', float('nan')):.2f} of ring_natural)",
                    flush=True,
                )
    result["pipeline"] = {}
    for length in args.pipeline_lengths:
        rows = result["pipeline"][str(length)] = {}
        for degree in args.degrees:
            rows[f"pp2xcp{degree}"] = row = build_pipelined(length, degree)
            row["temp_ratio_to_cp1"] = row["temp_bytes"] / rows["pp2xcp1"]["temp_bytes"] if degree > 1 else 1.0
            moved = {k: round(v / 2**20, 2) for k, v in row["collective_bytes"].items()}
            print(
                f"pipeline length {length:6d} pp2 x cp{degree}: temp {row['temp_bytes'] / 2**20:8.1f} MiB"
                f" (x{row['temp_ratio_to_cp1']:.2f} of cp1), collectives MiB {moved}",
                flush=True,
            )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
