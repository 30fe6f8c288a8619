"""Per-device memory and per-step communication of sharded data parallelism (fsdp) and tensor parallelism (tp).

    python -m benchmarks.sharding_memory [--out benchmarks/results/sharding_memory.json]

For a small GPT-2 and a small Llama (``transformers`` configs, random weights,
no download), trained with ``torch.optim.AdamW`` through ``@smp.step`` and
``smp.DistributedOptimizer`` on a fixed global batch, each strategy runs at
degree N = 1, 2, 4, 8 on the first N of 8 emulated CPU devices (so data
parallelism is 1: degree 1 is the whole step on one device, and ``total / N``
is the ideal of an N-way split). Nothing is executed; the training step is
lowered and compiled (``train_step.lower(...).compile()``) and read:

Memory, per device
    ``args``/``temp``/``out``: ``memory_analysis()`` of the step program
    (arguments: parameter shards, buffers, the batch; temporaries: activations,
    gathered parameters, unreduced gradients; outputs: the gradient shards).
    ``a+t ratio`` = (args + temp) / ((args + temp at degree 1) / N).
    ``held``: bytes of parameters + AdamW state actually resident on a device
    (``addressable_shards`` of ``model.params`` and ``optimizer.opt_state``,
    the most loaded device); ``held ratio`` = held / (total bytes / N). 1.0 is
    a perfect split; parameters under ``jmp.sharding.REPLICATED_BELOW``
    elements (biases, norms) stay whole under fsdp, and tp leaves norms,
    position tables and row-parallel biases whole, so both sit a little above 1.

Communication, per step, from the optimized HLO (``compiled.as_text()``)
    Every ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` and
    ``collective-permute`` instruction (async ``-start`` forms too; the step has
    no loops at ``microbatches=1``, so each instruction runs once) is counted at
    its *logical* size: the full buffer it produces or reduces (all-gather:
    its result; reduce-scatter: its operand, i.e. result x group; others: their
    result; tuples summed). ``param`` is the part of those bytes whose buffer
    has a parameter's full shape (gathered weights, whole gradients); the
    batch and sequence are chosen so that no activation shares a parameter's
    shape (the script checks). The JSON also gives ``wire`` bytes, what one
    device sends under ring algorithms ((g-1)/g of the logical size, twice
    that for all-reduce).
    Theory, fsdp (ZeRO-3): parameters are all-gathered twice (forward and
    backward) and their gradients reduce-scattered once, so with P_split the
    bytes of fsdp-split parameters and P_all of all parameters (the small
    replicated ones need a gradient all-reduce) the step moves 2 P_split of
    all-gather and P_all of gradient reduction. ``ag ratio`` = parameter-shaped
    all-gather / 2 P_split; ``grad ratio`` = parameter-shaped (all-reduce +
    reduce-scatter) / P_all. Theory, tp (Megatron): per layer two activation all-reduces
    forward and two backward of [tokens, hidden], one forward for the
    vocabulary-parallel embedding and one backward for the vocabulary-parallel
    LM head, three [tokens] reductions for the cross-entropy over split
    logits, no gradient reduction (dp = 1). ``total ratio`` = all measured
    bytes (parameters, activations, loss scalars) / the strategy's theoretical
    total: above 1 where XLA moves more than the textbook schedule, below 1
    where it moves less (e.g. one all-gather per parameter, not two).

CPU caveat: XLA:CPU has no ReduceScatterCreator pass, so the SPMD
partitioner's all-reduce + dynamic-slice is never turned into a
reduce-scatter; on CPU the fsdp gradient reduction appears as ``all-reduce``
of the full gradients (same logical bytes, twice the ring wire bytes, and the
full gradients live in ``temp``). On GPU/TPU it becomes a reduce-scatter.

Degrees that do not divide a model's heads or vocabulary are a ``ConfigError``
by design; the script records the message (``errors`` in the JSON). A Llama
with 4 key/value heads at tp=8 is probed on purpose to show it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import statistics
import time
from collections.abc import Callable

import jax
import torch
import transformers

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    gpt2_config,
    hlo_shapes,
    llama_config,
    lm_step,
    machine,
    replica_group_size,
    shape_bytes,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.errors import ConfigError

BATCH, SEQUENCE, POSITIONS, VOCAB, LR = 8, 64, 96, 640, 1e-3
DEGREES = (1, 2, 4, 8)
STRATEGIES = {"fsdp": "sharded_data_parallel_degree", "tp": "tensor_parallel_degree"}
# fsdp-once: sharded data parallelism with ``reshard_after_forward: False`` (each weight gathered once and
# kept until its backward: the behaviour before reshard_after_forward existed)
VARIANTS = {"fsdp-once": ("fsdp", {"reshard_after_forward": False})}
TIMED_STEPS = 10
MIB = 2**20

MODELS = {
    "gpt2": gpt2_config(vocab=VOCAB, positions=POSITIONS, d_model=192, layers=4, heads=8),
    "llama": llama_config(
        vocab=VOCAB, positions=POSITIONS, hidden=192, intermediate=384, layers=4, heads=8, kv_heads=8
    ),
}
# probed only for its error: 4 key/value heads cannot be split 8 ways
GQA_PROBE = ("llama_gqa4", dict(MODELS["llama"], num_key_value_heads=4), "tp", 8)

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)


# --- models and one measured configuration -------------------------------------------------------------------


def layers_and_hidden(spec: dict) -> tuple[int, int]:
    if spec["kind"] == "GPT2Config":
        return spec["n_layer"], spec["n_embd"]
    return spec["num_hidden_layers"], spec["hidden_size"]


def strategy_config(strategy: str, degree: int) -> dict:
    base, extra = VARIANTS.get(strategy, (strategy, {}))
    return {STRATEGIES[base]: degree, **extra} if degree > 1 else {}


def compile_step(spec: dict, strategy: str, degree: int):
    """(model, optimizer, compiled step) on the first ``degree`` devices; raises jmp's ConfigError."""
    smp.init(strategy_config(strategy, degree), devices=jax.devices()[:degree])
    model = smp.DistributedModel(causal_lm(spec))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR))
    ids = token_ids(BATCH, SEQUENCE, VOCAB)
    return model, optimizer, lm_step.lower(model, ids).compile()


# --- memory ---------------------------------------------------------------------------------------------------


def held_bytes(*trees) -> dict:
    """Bytes each device holds of the arrays in ``trees`` (their addressable shards), and their logical total."""
    per_device: dict = {}
    total = 0
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return {"max_per_device": max(per_device.values()), "min_per_device": min(per_device.values()), "total": total}


def parameter_bytes(params) -> dict:
    """Logical bytes of all parameters, of those split over fsdp, and of those split over tp."""
    leaves = [leaf for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array)]

    def split_over(axis: str) -> int:
        return sum(leaf.nbytes for leaf in leaves if axis in _axes(leaf.sharding.spec))

    return {"all": sum(leaf.nbytes for leaf in leaves), "fsdp_split": split_over("fsdp"), "tp_split": split_over("tp")}


def parameter_shapes(params) -> set[tuple[int, ...]]:
    """The parameters' full shapes; no activation may share one, or it would count as a parameter's collective."""
    shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array)}
    tokens = {BATCH * SEQUENCE // d for d in DEGREES} | {BATCH, SEQUENCE}
    clashes = sorted(s for s in shapes if len(s) <= 2 and tokens & set(s))
    if clashes:
        raise SystemExit(f"parameter shapes {clashes} share a size with the token counts {sorted(tokens)}; adjust")
    return shapes


def _axes(spec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        if entry is not None:
            names.update((entry,) if isinstance(entry, str) else entry)
    return names


def program_memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    return {
        "argument": stats.argument_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
        "output": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes,
        "args_plus_temp": stats.argument_size_in_bytes + stats.temp_size_in_bytes,
    }


# --- communication --------------------------------------------------------------------------------------------


def collectives(hlo: str, device_count: int, parameter_shapes: set[tuple[int, ...]]) -> list[dict]:
    """Each collective instruction of an optimized HLO module: kind, group size, logical and ring wire bytes.

    ``parameter`` is the part of the logical bytes whose (full) shape is a parameter's shape.
    """
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        kind = match["op"]
        shapes = hlo_shapes(match["type"])
        if match["start"] and kind in ("all-gather", "collective-permute", "reduce-scatter", "all-to-all"):
            shapes = shapes[len(shapes) // 2 :]  # an async start's result is (operands, results)
        group = replica_group_size(line, device_count)
        scale = group if kind == "reduce-scatter" else 1  # its operand, the full buffer, is `group` results
        logical = scale * sum(shape_bytes(dtype, dims) for dtype, dims in shapes)
        parameter = scale * sum(
            shape_bytes(dtype, dims) for dtype, dims in shapes if _full_shapes(kind, dims, group) & parameter_shapes
        )
        found.append(
            {"kind": kind, "group": group, "logical": logical, "parameter": parameter,
             "wire": _wire_bytes(kind, logical, group)}
        )  # fmt: skip
    return found


def _full_shapes(kind: str, dims: tuple[int, ...], group: int) -> set[tuple[int, ...]]:
    """The shapes of the full buffer a collective result may stand for (a reduce-scatter's is split on one dim)."""
    if kind != "reduce-scatter":
        return {dims}
    return {dims[:d] + (dims[d] * group,) + dims[d + 1 :] for d in range(len(dims))}


def _wire_bytes(kind: str, logical: int, group: int) -> float:
    if kind == "collective-permute":
        return float(logical)
    share = (group - 1) / group if group > 1 else 0.0
    return (2 if kind == "all-reduce" else 1) * share * logical


def by_kind(found: list[dict]) -> dict:
    summary = {kind: {"count": 0, "logical": 0, "parameter": 0, "wire": 0.0} for kind in KINDS}
    for c in found:
        entry = summary[c["kind"]]
        entry["count"] += 1
        for key in ("logical", "parameter", "wire"):
            entry[key] += c[key]
    return summary


def theoretical(strategy: str, degree: int, params: dict, spec: dict) -> dict:
    """Logical collective bytes the strategy needs per step (see the module docstring)."""
    if degree == 1:
        return {"all_gather": 0, "grad_reduction": 0, "activations": 0, "total": 0}
    if strategy.startswith("fsdp"):
        gathers, reduction = 2 * params["fsdp_split"], params["all"]
        return {"all_gather": gathers, "grad_reduction": reduction, "activations": 0, "total": gathers + reduction}
    layers, hidden = layers_and_hidden(spec)
    tokens, itemsize = BATCH * SEQUENCE, 4
    activations = (4 * layers + 2) * tokens * hidden * itemsize + 3 * tokens * itemsize
    return {"all_gather": 0, "grad_reduction": 0, "activations": activations, "total": activations}


def comm_ratios(strategy: str, measured: dict, theory: dict) -> dict:
    """fsdp: parameter-shaped all-gathers and reductions against theirs; every strategy: all bytes against all."""
    total = sum(v["logical"] for v in measured.values())
    reduction = measured["all-reduce"]["parameter"] + measured["reduce-scatter"]["parameter"]
    return {
        "all_gather": _ratio(measured["all-gather"]["parameter"], theory["all_gather"]),
        "grad_reduction": _ratio(reduction, theory["grad_reduction"]) if strategy.startswith("fsdp") else None,
        "total": _ratio(total, theory["total"]),
    }


def _ratio(measured: float, ideal: float) -> float | None:
    return measured / ideal if ideal else None


# --- rows -------------------------------------------------------------------------------------------------------


def measure(name: str, spec: dict, strategy: str, degree: int) -> dict:
    start = time.perf_counter()
    model, optimizer, compiled = compile_step(spec, strategy, degree)
    params = parameter_bytes(model.params)
    held = held_bytes(model.params, optimizer.opt_state)
    shapes = parameter_shapes(model.params)
    hlo = compiled.as_text()
    found = collectives(hlo, degree, shapes)
    measured = by_kind(found)
    theory = theoretical(strategy, degree, params, spec)
    held["ideal"] = held["total"] / degree
    held["ratio"] = held["max_per_device"] / held["ideal"]
    row = {
        "model": name,
        "strategy": strategy if degree > 1 else "none",
        "degree": degree,
        "mesh": {k: v for k, v in smp.get_mesh().shape.items() if v > 1},
        "parameter_bytes": params,
        "memory": program_memory(compiled),
        "held_params_and_opt": held,
        "comm": measured,
        "comm_theoretical": theory,
        "comm_ratio": comm_ratios(strategy, measured, theory),
        "hlo_has_loops": " while(" in hlo,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    del model, optimizer, compiled
    gc.collect()
    return row


def step_times(degree: int = 8) -> list[dict]:
    """Seconds per training step (forward, backward and AdamW update) under fsdp, with and without
    reshard_after_forward, timed round-robin in one process (medians)."""
    rows = []
    ids = token_ids(BATCH, SEQUENCE, VOCAB)
    for name, spec in MODELS.items():
        runs, prepare = {}, {}
        for strategy in ("fsdp", "fsdp-once"):
            config = strategy_config(strategy, degree)
            smp.init(config)
            model = smp.DistributedModel(causal_lm(spec))
            optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR))

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = lm_step(model, ids)
                optimizer.step()
                return loss.reduce_mean(), model.training_state.params  # ready after the update

            runs[strategy], prepare[strategy] = step, functools.partial(smp.init, config)
        samples = time_interleaved(runs, TIMED_STEPS, prepare=prepare)
        medians = {k: statistics.median(v) for k, v in samples.items()}
        rows.append({
            "model": name,
            "degree": degree,
            "seconds": medians,
            "reshard_cost": medians["fsdp"] / medians["fsdp-once"],
        })  # fmt: skip
        print(f"  {name} fsdp={degree} step: {medians} (ratio {rows[-1]['reshard_cost']:.2f})", flush=True)
    return rows


def add_memory_ideals(rows: list[dict]) -> None:
    """args + temp against (args + temp at degree 1) / N, per model."""
    base = {r["model"]: r["memory"]["args_plus_temp"] for r in rows if r["degree"] == 1}
    for r in rows:
        ideal = base[r["model"]] / r["degree"]
        r["memory"]["ideal_args_plus_temp"] = ideal
        r["memory"]["ratio"] = r["memory"]["args_plus_temp"] / ideal


def run_all() -> tuple[list[dict], list[dict]]:
    rows, errors = [], []
    plan = [(n, s, "fsdp", 1) for n, s in MODELS.items()]
    strategies = [*STRATEGIES, *VARIANTS]
    plan += [(n, s, strategy, d) for n, s in MODELS.items() for strategy in strategies for d in DEGREES if d > 1]
    plan.append(GQA_PROBE)
    for name, spec, strategy, degree in plan:
        try:
            rows.append(measure(name, spec, strategy, degree))
            print(f"  {name} {strategy}={degree}: {rows[-1]['seconds']:.1f}s", flush=True)
        except ConfigError as error:
            errors.append({"model": name, "strategy": strategy, "degree": degree, "error": str(error)})
            print(f"  {name} {strategy}={degree}: ConfigError: {error}", flush=True)
    if not any(e["model"] == GQA_PROBE[0] for e in errors):
        errors.append({"model": GQA_PROBE[0], "strategy": "tp", "degree": 8, "error": None, "note": "expected one"})
    add_memory_ideals(rows)
    return rows, errors


# --- output -----------------------------------------------------------------------------------------------------

_COLUMNS: list[tuple[str, str, Callable[[dict], str]]] = [
    ("model", "<6", lambda r: r["model"]),
    ("strat", "<9", lambda r: r["strategy"]),
    ("N", ">2", lambda r: str(r["degree"])),
    ("args", ">6", lambda r: _mib(r["memory"]["argument"])),
    ("temp", ">6", lambda r: _mib(r["memory"]["temp"])),
    ("a+t", ">6", lambda r: _mib(r["memory"]["args_plus_temp"])),
    ("ideal", ">6", lambda r: _mib(r["memory"]["ideal_args_plus_temp"])),
    ("ratio", ">5", lambda r: f"{r['memory']['ratio']:.2f}"),
    ("held", ">6", lambda r: _mib(r["held_params_and_opt"]["max_per_device"])),
    ("ideal", ">6", lambda r: _mib(r["held_params_and_opt"]["ideal"])),
    ("ratio", ">5", lambda r: f"{r['held_params_and_opt']['ratio']:.2f}"),
    ("AG", ">6", lambda r: _mib(r["comm"]["all-gather"]["logical"])),
    ("AR", ">6", lambda r: _mib(r["comm"]["all-reduce"]["logical"])),
    ("RS", ">6", lambda r: _mib(r["comm"]["reduce-scatter"]["logical"])),
    ("A2A", ">6", lambda r: _mib(r["comm"]["all-to-all"]["logical"])),
    ("CP", ">6", lambda r: _mib(r["comm"]["collective-permute"]["logical"])),
    ("param", ">6", lambda r: _mib(sum(v["parameter"] for v in r["comm"].values()))),
    ("theory", ">6", lambda r: _mib(r["comm_theoretical"]["total"])),
    ("ag", ">5", lambda r: _fmt(r["comm_ratio"]["all_gather"])),
    ("grad", ">5", lambda r: _fmt(r["comm_ratio"]["grad_reduction"])),
    ("total", ">5", lambda r: _fmt(r["comm_ratio"]["total"])),
]


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    header = "  ".join(f"{title:{align}}" for title, align, _ in _COLUMNS)
    lines = [
        "memory per device in MiB (a+t = args + temp of the step program, ideal = a+t at N=1 / N;",
        "held = params + AdamW state on the most loaded device, ideal = total / N);",
        "comm: logical MiB per step by kind (AG all-gather, AR all-reduce, RS reduce-scatter, A2A all-to-all,",
        "CP collective-permute; param = the part of them shaped like a parameter); ratios = measured / theory",
        "(ag: parameter all-gathers vs 2 x fsdp-split params; grad: parameter AR+RS vs all params; total: all",
        "kinds vs the strategy's total). CPU: the fsdp reduce-scatter shows up as AR (XLA:CPU forms none).",
        "",
        header,
        "-" * len(header),
    ]
    for r in sorted(rows, key=lambda r: (r["model"], r["strategy"] != "none", r["strategy"], r["degree"])):
        lines.append("  ".join(f"{show(r):{align}}" for _, align, show in _COLUMNS))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/sharding_memory.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    emulate_devices()

    rows, errors = run_all()
    timings = step_times()
    print()
    print(table(rows))
    for e in errors:
        print(f"\n{e['model']} {e['strategy']}={e['degree']}: {e['error']}")
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**machine(), "transformers": transformers.__version__},
        "config": dict(
            batch=BATCH,
            sequence=SEQUENCE,
            optimizer="AdamW",
            dtype="float32",
            degrees=DEGREES,
            devices_per_degree="the first N of the emulated devices (dp = 1)",
            models=MODELS,
        ),  # fmt: skip
        "notes": [
            "comm bytes are logical (full buffer produced or reduced); 'wire' assumes ring algorithms",
            "XLA:CPU forms no reduce-scatter: the fsdp gradient reduction is an all-reduce + dynamic-slice here",
            "fsdp theory: 2 all-gathers of the fsdp-split parameters + one reduction of every gradient",
            "tp theory: (4 layers + 2) activation all-reduces of [tokens, hidden] + 3 [tokens] loss reductions",
            "fsdp: reshard_after_forward (the default); fsdp-once: reshard_after_forward False",
            "step_times: medians of round-robin timed steps on this CPU; reshard_cost = fsdp / fsdp-once",
        ],
        "rows": rows,
        "step_times": timings,
        "errors": errors,
    }
    write_results(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
