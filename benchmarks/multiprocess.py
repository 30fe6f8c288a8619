"""One host, several processes: the same GPT-2 step on 8 CPU devices as 1 x 8, 2 x 4 and 4 x 2 processes x devices.

    python -m benchmarks.multiprocess [--steps 8] [--warmup 2] [--out benchmarks/results/multiprocess.json]

GPT-2 (Hugging Face, from a config, random weights, no dropout) with 4 layers, d_model 256, 4 heads, vocab
512, 128 positions; a global batch of 16 x 128 tokens; ``torch.optim.AdamW`` (lr 1e-3) through
``smp.DistributedOptimizer``. Layouts on the 8 devices: ``dp`` (``{}``: 8-way data parallelism),
``sdp4_tp2`` (``{"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2}``), and ``dp`` with 2
microbatches, its gradients kept per replica through the microbatch loop and reduced once after it (``dp_mb2``,
``jmp.compiled_step.replica_gradients``: with several processes, per process and replica within it) or, with
the per-replica copies turned off while the step compiles, reduced where each microbatch's backward makes them
(``dp_mb2_per_mb``, as GSPMD places them); the same two with tp2 beside 4-way data parallelism
(``dp4_tp2_mb2``, ``dp4_tp2_mb2_per_mb``: on 4 x 2 a process holds a whole replica, on 2 x 4 two, whose
gradients it sums each microbatch as its parameters are split; on 8 x 1, not run, each tensor-parallel rank would
feed rows of its own).

Each configuration runs in processes of its own, all started the same way::

    python -m jmp.launch -n N --cpu-devices K -m benchmarks.multiprocess --worker --steps S --warmup W

with (N, K) = (1, 8), (2, 4), (4, 2) (N = 1: one process, JAX's distributed runtime is not started; N > 1:
``smp.init`` joins the processes through ``jax.distributed``, collectives between processes go through gloo
over loopback TCP). Every process runs both layouts, one after the other (``smp.init(layout)`` again), and
feeds its share of the same global batch (``ids.chunk(smp.dp_size())[smp.dp_rank()]``); process 0 prints one
JSON line per layout, which this script (the parent) collects.

Time
    Per iteration: ``optimizer.zero_grad()``, the step (``harness.lm_step``: forward + backward), then
    ``jax.block_until_ready(model.training_state.grads)`` (the step program's outputs are all ready when it
    ends) -> *step* seconds; then ``optimizer.step()`` and ``jax.block_until_ready`` of the updated parameters
    -> *iteration* seconds (step + update). ``--warmup`` untimed iterations (the first traces), then medians
    of ``--steps`` timed ones, as process 0 sees them (the collectives keep the processes in lockstep).
    Ratios are to 1 x 8 of the same layout. The loss after the last iteration (``float(loss.reduce_mean())``)
    is recorded as a check that every configuration trains the same model on the same batch.

Collective bytes (from the compiled step program, ``lm_step.lower(model, share).compile().as_text()``)
    Every ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` and ``collective-permute``
    instruction (``-start`` of the async forms; ``-done`` not counted again). Its bytes: the bytes of its
    operands on one device (the optimized HLO names operands without types, so each operand's type is looked
    up from the instruction that defines it). Per step: the sum over instructions, each counted once; those in
    a ``while`` body (the microbatch loop's) run once per microbatch: their count is ``in_while_bodies``, their
    bytes per execution ``while_body_bytes`` (``while_body_cross_bytes`` across processes).

    Which devices an instruction joins: its ``replica_groups`` in any of XLA's spellings: explicit
    (``{{0,1},{2,3}}``; ``{}``: all devices), iota (``[G,S]<=[dims]T(perm)``: ``arange`` reshaped to dims,
    transposed, reshaped to G groups of S) or mesh axes (``mesh['a'=4,'b'=2] {'a'}``, with an optional
    ``device_ids=(...)``, and sub-axes ``'a':(pre)size``: a group is the devices that share their coordinates
    on the other axes); for ``collective-permute`` its ``source_target_pairs``. The parsed groups of a
    grouped collective are checked to partition the devices. The numbers in these lists are not device ids
    (a process's CPU devices are numbered ``process_index * 2048 + k`` in multi-process runs): the step is one
    SPMD program with ``replica_count=1`` and ``num_partitions=8``, so with ``use_global_device_ids=true``
    (global id = replica * num_partitions + partition) as with a channel id alone (cross-partition mode),
    they are partition ids, and partition p runs on entry p of the program's device assignment, which JAX
    takes from the flattened mesh: ``mesh.devices.flat`` of the step's input shardings. (Checked on a mesh of
    permuted devices: an ``all-gather`` within mesh rows reads ``[2,4]<=[8]``, mesh positions, not ids.)
    ``device.process_index`` of those devices then says which processes a group spans; an instruction is
    *cross-process* when one of its groups (pairs) holds devices of more than one process, and its bytes count
    in the cross-process part. These are logical bytes per device, not bytes on the wire (a ring all-reduce
    sends about 2 (g-1)/g of its buffer; within a process XLA:CPU copies in memory).

The whole default run takes about 11 minutes on 2 CPU cores (each configuration compiles both layouts in every
one of its processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
import torch
import transformers

import jmp as smp
from benchmarks import gradient_reduction
from benchmarks.harness import (
    causal_lm,
    gpt2_config,
    hlo_shapes,
    lm_step,
    machine,
    shape_bytes,
    token_ids,
    write_results,
)

MARK = "MULTIPROCESS_RESULT "
LAYERS, D_MODEL, HEADS, VOCAB, SEQUENCE, BATCH, LR = 4, 256, 4, 512, 128, 16, 1e-3
DEVICES = 8
CONFIGS = ((1, DEVICES), (2, DEVICES // 2), (4, DEVICES // 4))  # processes x devices per process
LAYOUTS = {
    "dp": {},
    "sdp4_tp2": {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2},
    "dp_mb2": {"microbatches": 2},
    "dp_mb2_per_mb": {"microbatches": 2},  # gradients reduced where they are made: once per microbatch
    "dp4_tp2_mb2": {"tensor_parallel_degree": 2, "microbatches": 2},
    "dp4_tp2_mb2_per_mb": {"tensor_parallel_degree": 2, "microbatches": 2},
}
PER_MICROBATCH = {"dp_mb2_per_mb", "dp4_tp2_mb2_per_mb"}  # compiled with the per-replica copies turned off
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
MIB = 2**20

# --- HLO collectives ----------------------------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?)\b([a-z][a-z0-9\-]*)\(")
_COLLECTIVE = re.compile(r"^(" + "|".join(KINDS) + r")(-start)?$")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.\-]+)")


def _operands(line: str, opcode_end: int) -> str:
    """The text inside the opcode's parentheses (operand lists hold no nested parentheses but types' layouts)."""
    depth, start = 0, opcode_end
    for i in range(opcode_end, len(line)):
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
            if depth == 0:
                return line[start + 1 : i]
    raise ValueError(f"unbalanced operand list: {line[:200]}")


def _iota(spec: str) -> np.ndarray:
    """``[dims]<=[reshape]T(perm)`` (or ``<=[n]``): XLA's iota tile assignment, as an array of ids; a mesh's
    ``device_ids`` also reads ``[reshape]T(perm)``, the ids in the order of the mesh's axes."""
    match = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", spec.strip())
    if match is None or (match[2] is None and match[3] is None):
        raise ValueError(f"not an iota list: {spec!r}")
    dims = [int(d) for d in match[1].split(",")]
    reshape = [int(d) for d in match[2].split(",")] if match[2] else dims
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if match[3]:
        ids = ids.transpose([int(p) for p in match[3].split(",")])
    return ids.reshape(dims)


def _mesh_groups(text: str) -> list[list[int]]:
    """Groups of XLA's mesh-axes spelling: ``mesh['a'=4,'b'=2][, device_ids=(...)] {'a', 'b':(1)2}``."""
    match = re.match(r"mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))?\s*\{([^}]*)\}", text)
    if match is None:
        raise ValueError(f"unparsed mesh replica groups: {text[:200]!r}")
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", match[1])]
    sizes = [size for _, size in axes]
    if match[2] is None:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    elif "<=" in match[2] or "T(" in match[2]:
        ids = _iota(match[2]).reshape(sizes)
    else:
        ids = np.array([int(i) for i in re.sub(r"^\[[\d,]*\]", "", match[2]).split(",")]).reshape(sizes)
    refs = [(name, int(pre) if pre else None, int(sub) if sub else None)
            for name, pre, sub in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", match[3])]  # fmt: skip
    # split each axis into factors at its sub-axes' bounds: sub-axis (pre)size of an axis of n devices is the
    # middle factor of n = pre x size x rest, major to minor, so factors run from bound 1 (the major end) up
    bounds = {name: {1, size} for name, size in axes}
    for name, pre, sub in refs:
        if pre is not None:
            bounds[name] |= {pre, pre * sub}
    factors = []  # (axis, lower bound, size), major to minor
    for name, _ in axes:
        marks = sorted(bounds[name])
        factors += [(name, lo, hi // lo) for lo, hi in zip(marks, marks[1:])]
    grouped = [
        k for name, pre, sub in refs for k, (axis, lo, _) in enumerate(factors)
        if axis == name and (pre is None or pre <= lo < pre * sub)
    ]  # fmt: skip
    kept = [k for k in range(len(factors)) if k not in grouped]
    expanded = ids.reshape([size for _, _, size in factors])
    return expanded.transpose(kept + grouped).reshape(-1, math.prod(factors[k][2] for k in grouped)).tolist()


def replica_groups(line: str, devices: int) -> list[list[int]]:
    """The groups of partition ids a collective instruction joins (collective-permute: its (source, target) pairs)."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs[1] + "}")]
    start = line.find("replica_groups=")
    if start < 0:
        return [list(range(devices))]
    text = line[start + len("replica_groups=") :]
    if text.startswith("mesh["):
        groups = _mesh_groups(text)
    elif text.startswith("{"):
        explicit = re.match(r"\{((?:\{[\d,]*\},?)*)\}", text)
        groups = [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", explicit[1])]
        groups = groups or [list(range(devices))]
    else:
        groups = _iota(re.match(r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?", text)[0]).tolist()
    members = sorted(i for g in groups for i in g)
    if members != list(range(devices)):
        raise ValueError(f"replica groups {groups} do not partition {devices} devices: {line[:300]}")
    return groups


def collectives(hlo: str, process_of: Sequence[int]) -> list[dict]:
    """Each collective instruction of an optimized HLO module: kind, operand bytes (one device), groups, and
    whether a group spans processes (``process_of[partition id]``)."""
    header = hlo.split("\n", 1)[0]
    replicas = re.search(r"replica_count=(\d+)", header)
    partitions = re.search(r"num_partitions=(\d+)", header)
    if (replicas and int(replicas[1]) != 1) or (partitions and int(partitions[1]) != len(process_of)):
        raise ValueError(f"expected one replica of {len(process_of)} partitions: {header[:300]}")
    types: dict[str, str] = {}
    found, computation = [], None
    loop_bodies = set(_WHILE_BODY.findall(hlo))
    for line in hlo.splitlines():
        if (head := _COMPUTATION.match(line)) and " = " not in line.split("{", 1)[0]:
            computation = head[2]
            continue
        definition = _DEFINITION.match(line)
        if definition is None:
            continue
        name, result_type, opcode = definition.groups()
        types[name] = result_type
        collective = _COLLECTIVE.match(opcode)
        if collective is None:
            continue
        operands = _operands(line, definition.end() - 1)
        shapes = hlo_shapes(operands)  # operands printed with their types
        if not shapes:
            shapes = [s for ref in re.findall(r"%([\w.\-]+)", operands) for s in hlo_shapes(types[ref])]
        groups = replica_groups(line, len(process_of))
        spans = [len({process_of[i] for i in group}) for group in groups]
        found.append(
            {"kind": collective[1], "bytes": sum(shape_bytes(dtype, dims) for dtype, dims in shapes),
             "group_size": max(len(g) for g in groups), "cross_process": max(spans) > 1,
             "in_while_body": computation in loop_bodies}
        )  # fmt: skip
    return found


def summarize(found: list[dict]) -> dict:
    kinds = {kind: {"count": 0, "bytes": 0, "cross_count": 0, "cross_bytes": 0} for kind in KINDS}
    for c in found:
        entry = kinds[c["kind"]]
        entry["count"] += 1
        entry["bytes"] += c["bytes"]
        entry["cross_count"] += c["cross_process"]
        entry["cross_bytes"] += c["bytes"] if c["cross_process"] else 0
    total = {key: sum(k[key] for k in kinds.values()) for key in ("count", "bytes", "cross_count", "cross_bytes")}
    looped = [c for c in found if c["in_while_body"]]
    return {
        **total,
        "in_while_bodies": len(looped),
        "while_body_bytes": sum(c["bytes"] for c in looped),  # per execution of the body
        "while_body_cross_bytes": sum(c["bytes"] for c in looped if c["cross_process"]),
        "by_kind": kinds,
    }


# --- worker (one process of a launch) ------------------------------------------------------------------------------


def measure(name: str, layout: dict, steps: int, warmup: int) -> dict:
    smp.init(layout)
    spec = gpt2_config(vocab=VOCAB, positions=SEQUENCE, d_model=D_MODEL, layers=LAYERS, heads=HEADS)
    model = smp.DistributedModel(causal_lm(spec))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    ids = token_ids(BATCH, SEQUENCE, VOCAB)
    share = ids.chunk(smp.dp_size())[smp.dp_rank()]  # what this process's data loader yields

    start = time.perf_counter()
    compiled = lm_step.lower(model, share).compile()
    compile_seconds = time.perf_counter() - start
    shardings = [s for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "mesh")]
    assignment = list(shardings[0].mesh.devices.flat)  # partition p runs on assignment[p]
    comm = summarize(collectives(compiled.as_text(), [d.process_index for d in assignment]))

    step_times, iteration_times = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = lm_step(model, share)
        jax.block_until_ready(model.training_state.grads)
        stepped = time.perf_counter()
        optimizer.step()
        jax.block_until_ready(model.training_state.params)
        if i >= warmup:
            step_times.append(stepped - start)
            iteration_times.append(time.perf_counter() - start)
    mesh = smp.get_mesh()
    return {
        "layout": name,
        "config": layout,
        "processes": jax.process_count(),
        "devices_per_process": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        "dp_size": smp.dp_size(),
        "share_rows": share.shape[0],
        "partition_process": [d.process_index for d in assignment],
        "compile_seconds": compile_seconds,
        "median_step_seconds": statistics.median(step_times),
        "median_iteration_seconds": statistics.median(iteration_times),
        "step_seconds": step_times,
        "iteration_seconds": iteration_times,
        "final_loss": float(loss.reduce_mean()),
        "collectives": comm,
    }


def worker(steps: int, warmup: int) -> None:
    transformers.logging.set_verbosity_error()
    for name, layout in LAYOUTS.items():
        with gradient_reduction.replica_copies(name not in PER_MICROBATCH):
            result = measure(name, layout, steps, warmup)
        if jax.process_index() == 0:
            print(MARK + json.dumps({**result, "machine": machine()}), flush=True)


# --- parent ------------------------------------------------------------------------------------------------------


def launch(processes: int, devices: int, steps: int, warmup: int) -> tuple[list[str], list[dict], float]:
    command = [sys.executable, "-m", "jmp.launch", "-n", str(processes), "--cpu-devices", str(devices), "-m",
               "benchmarks.multiprocess", "--worker", "--steps", str(steps), "--warmup", str(warmup)]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"{' '.join(command)} failed with code {done.returncode}")
    results = [json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    return command, results, seconds


def table(rows: list[dict]) -> str:
    lines = [
        f"{'layout':<18} {'procs x dev':>11} {'step s':>7} {'ratio':>6} {'iter s':>7} {'ratio':>6} "
        f"{'colls':>5} {'MiB/step':>8} {'x-proc':>6} {'x-proc MiB':>10} {'in loop':>10} {'loss':>7}"
    ]
    for r in rows:
        c = r["collectives"]
        lines.append(
            f"{r['layout']:<18} {r['processes']:>5} x {r['devices_per_process']:<3} "
            f"{r['median_step_seconds']:>7.3f} {r['step_ratio']:>6.2f} {r['median_iteration_seconds']:>7.3f} "
            f"{r['iteration_ratio']:>6.2f} {c['count']:>5} {c['bytes'] / MIB:>8.2f} {c['cross_count']:>6} "
            f"{c['cross_bytes'] / MIB:>10.2f} {c['while_body_cross_bytes'] / MIB:>10.2f} {r['final_loss']:>7.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    parser.add_argument("--out", default="benchmarks/results/multiprocess.json")
    parser.add_argument("--worker", action="store_true", help="run as one process of a launch (internal)")
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.warmup)
        return

    start = time.perf_counter()
    rows, runs = [], []
    for processes, devices in CONFIGS:
        command, results, seconds = launch(processes, devices, args.steps, args.warmup)
        if len(results) != len(LAYOUTS):
            raise SystemExit(f"{' '.join(command)} printed {len(results)} results, expected {len(LAYOUTS)}")
        runs.append({"command": " ".join(command[1:]), "wall_seconds": seconds})
        rows += results
        print(f"{processes} x {devices} done ({seconds:.0f}s)", flush=True)
    base = {r["layout"]: r for r in rows if r["processes"] == 1}
    for r in rows:
        r["step_ratio"] = r["median_step_seconds"] / base[r["layout"]]["median_step_seconds"]
        r["iteration_ratio"] = r["median_iteration_seconds"] / base[r["layout"]]["median_iteration_seconds"]
    seconds = time.perf_counter() - start

    print()
    print(table(rows))
    print(
        "\nstep: forward + backward; iter: + optimizer.step(); ratio: to 1 x 8 of the layout; colls: collective "
        "instructions in the step program, MiB/step: their operand bytes per device; x-proc: those whose replica "
        "groups span processes, and their bytes; in loop: those bytes inside the microbatch loop's body, per microbatch"
    )
    measured_on = rows[0]["machine"]  # process 0 of the 1 x 8 run
    for r in rows:
        del r["machine"]
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**measured_on, "transformers": transformers.__version__},
        "config": dict(
            layers=LAYERS,
            d_model=D_MODEL,
            heads=HEADS,
            vocab=VOCAB,
            sequence=SEQUENCE,
            batch=BATCH,
            optimizer="AdamW",
            lr=LR,
            layouts=LAYOUTS,
            timed_iterations=args.steps,
            warmup_iterations=args.warmup,
        ),  # fmt: skip
        "runs": runs,
        "results": rows,
        "seconds": seconds,
    }
    write_results(args.out, result)
    print(f"\nwrote {args.out} ({seconds:.0f}s)")


if __name__ == "__main__":
    main()
