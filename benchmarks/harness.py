"""What the benchmarks share: emulated devices, the timing loop, small models, HLO byte counts, the results file."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import numpy as np
import torch
import transformers

import jmp as smp

# --- devices ----------------------------------------------------------------------------------------------------


def emulate_devices(count: int = 8) -> None:
    """Give JAX ``count`` emulated CPU devices, unless ``XLA_FLAGS`` already names a host device count.

    XLA reads the device count when JAX starts its backend (the first device query or computation), not when
    ``jax`` is imported, so this may run after the imports; call it first thing in ``main``. JAX raises a
    RuntimeError if its backend has already started with another count.
    """
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    jax.config.update("jax_num_cpu_devices", count)


# --- timing -----------------------------------------------------------------------------------------------------


def time_interleaved(
    runs: Mapping[str, Callable[[], Any]],
    steps: int,
    warmup: int = 2,
    prepare: Mapping[str, Callable[[], Any]] | None = None,
    block: int = 1,
) -> dict[str, list[float]]:
    """Seconds of each call of each run: ``warmup`` untimed rounds, then ``steps`` timed rounds.

    A round calls every run once, or ``block`` times in a row (as a training loop runs its step; the first call
    of a block, the one after another run's, is then untimed); the order is reversed every other round so that
    drift on a shared machine falls on all runs alike. A call is timed until what it returns is ready
    (``jax.block_until_ready``: JAX dispatches asynchronously). ``prepare[name]``, if given, runs untimed before
    each block of that run (e.g. ``smp.init`` with the config the run's model was built under).
    """
    prepare = prepare or {}
    order = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in order}
    for i in range(warmup + steps):
        for name in order if i % 2 else order[::-1]:
            if name in prepare:
                prepare[name]()
            for call in range(block):
                start = time.perf_counter()
                jax.block_until_ready(runs[name]())
                if i >= warmup and (call > 0 or block == 1):
                    samples[name].append(time.perf_counter() - start)
    return samples


def medians(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(times) for name, times in samples.items()}


# --- models -----------------------------------------------------------------------------------------------------


def gpt2_config(*, vocab: int, positions: int, d_model: int, layers: int, heads: int, dropout: bool = False) -> dict:
    """A small ``transformers.GPT2Config`` as data (``kind`` names the class): no dropout unless asked, token ids 0."""
    spec = dict(
        kind="GPT2Config", vocab_size=vocab, n_embd=d_model, n_layer=layers, n_head=heads, n_positions=positions
    )
    if not dropout:
        spec.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return dict(spec, bos_token_id=0, eos_token_id=0)


def llama_config(
    *, vocab: int, positions: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict:
    """A small ``transformers.LlamaConfig`` as data (``kind`` names the class), token ids 0."""
    return dict(
        kind="LlamaConfig", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=positions, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def causal_lm(spec: dict) -> torch.nn.Module:
    """The Hugging Face causal LM of ``spec`` with random weights (torch seed 0, so equal specs give equal
    weights), in training mode; nothing is downloaded."""
    torch.manual_seed(0)
    config = getattr(transformers, spec["kind"])(**{k: v for k, v in spec.items() if k != "kind"})
    return transformers.AutoModelForCausalLM.from_config(config).train()


def token_ids(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@smp.step
def lm_step(model, ids):
    """Forward and backward of a causal LM on ``ids`` as its own labels; the loss per microbatch."""
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out.loss


# --- compiled programs --------------------------------------------------------------------------------------------

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r"|f8\w*)\[([\d,]*)\]")


def named_grads(grads: Any) -> dict[str, np.ndarray]:
    """A DistributedModel's gradients (an nnx.State) by torch parameter name, as numpy arrays."""
    return {
        ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
    }


def hlo_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array type written in HLO ``text`` (``f32[8,128]``...), as (dtype, dims), in order."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def shape_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return math.prod(dims) * DTYPE_BYTES.get(dtype, 1)  # f8 variants: one byte


def replica_group_size(line: str, device_count: int) -> int:
    """Devices per replica group of a collective instruction, from any of XLA's three spellings (explicit, iota,
    mesh axes)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh[2]))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if iota:
        return int(iota[1].split(",")[-1])
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit[1].split(","))
    return device_count  # no groups given: all devices (collective-permute has pairs, not groups)


# an instruction's called computations: fusions, conditional branches, reducers, nested loops
_CALLED = re.compile(r"(?:calls|computations|to_apply|body|condition)=(\{[^}]*\}|%[\w.\-]+)")


def all_reduce_bytes(hlo: str, group: int | None = None, device_count: int = 8) -> dict[str, int]:
    """Bytes of the all-reduce results of an optimized HLO module inside while-loop bodies (a microbatch loop's,
    a pipeline's schedule loop), with the computations they call (a stage's branch of a conditional), and outside
    them; only those over groups of ``group`` devices when given."""
    blocks = {}
    for block in re.split(r"\n(?=\S)", hlo):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if name is not None:
            blocks[name.group(1)] = block
    in_loop, pending = set(), re.findall(r"body=%([\w.\-]+)", hlo)
    while pending:  # the bodies and every computation they reach
        name = pending.pop()
        if name in in_loop or name not in blocks:
            continue
        in_loop.add(name)
        for called in _CALLED.findall(blocks[name]):
            pending += re.findall(r"%([\w.\-]+)", called)
    totals = {"in_loop": 0, "outside_loop": 0}
    for name, block in blocks.items():
        where = "in_loop" if name in in_loop else "outside_loop"
        for line in block.splitlines():
            if not re.search(r" all-reduce(?:-start)?\(", line):
                continue
            if group is None or replica_group_size(line, device_count) == group:
                result = line.split("=", 1)[1].split("all-reduce")[0]
                totals[where] += sum(shape_bytes(dtype, dims) for dtype, dims in hlo_shapes(result))
    return totals


# --- results ------------------------------------------------------------------------------------------------------


def machine() -> dict:
    """What every result records beside its numbers: the machine and the versions it ran."""
    return dict(
        platform=platform.platform(),
        cpus=os.cpu_count(),
        jax=jax.__version__,
        flax=flax.__version__,
        torch=torch.__version__,
        devices=jax.device_count(),
        backend=jax.default_backend(),
    )


def write_results(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
