"""Processes, each with the devices ``jmp.launch`` gives it, data parallel with 2 microbatches: each replica's
gradients are kept through the microbatch loop and reduced once after it. Prints, per process, its ranks, the
gradients of one step by torch name, whether the model's layer list is stored stacked, and the bytes of the
all-reduces inside the compiled step's loop and outside it; then the same for an fp8 Linear over three steps,
with 1 microbatch and with 2, with its scaling state after each (amax histories of the length given); then the
first model with tp2 beside the data parallelism (``tensor_parallel_report``). As JSON in ``report_<rank>.json``
in the directory given (lines this long printed by several processes can interleave).

    python -m jmp.launch -n N --cpu-devices K tests/multiprocess/replica_gradients_script.py DIRECTORY HISTORY
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx
from jax.experimental import multihost_utils

import jmp as smp
from benchmarks import gradient_reduction
from benchmarks.harness import all_reduce_bytes, named_grads
from tests.multiprocess.replica_gradients_model import FP8_FACTORS, batch, fp8_batch, fp8_linear, net


@smp.step
def train_step(model, images, labels):
    loss = F.nll_loss(model(images), labels)
    model.backward(loss)
    return loss


@smp.step
def fp8_step(model, x, grad_out):
    model.backward((model(x) * grad_out).sum())  # the output's gradient is grad_out itself


def fp8_steps(history: int, microbatches: int) -> dict:
    """The fp8 Linear's gradients and scaling state after each of its steps (SGD at lr 0: the weight stays)."""
    smp.init({"fp8": True, "fp8_amax_history_len": history, "microbatches": microbatches, "ddp": True})
    model = smp.DistributedModel(fp8_linear())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x, grad_out = (t.chunk(smp.dp_size())[smp.dp_rank()] for t in fp8_batch())
    steps = []
    for factor in FP8_FACTORS:
        optimizer.zero_grad()
        fp8_step(model, x * factor, grad_out * factor)
        grads = {name: g.tolist() for name, g in named_grads(model.grads).items()}
        optimizer.step()
        flat = nnx.to_flat_state(model.training_state.rest)
        state = {"/".join(map(str, path)): np.asarray(v[...]).tolist() for path, v in flat if "fp8" in path}
        steps.append({"grads": grads, "state": state})
    hlo = fp8_step.lower(model, x, grad_out).compile().as_text()
    return {"steps": steps, "all_reduce_bytes": all_reduce_bytes(hlo, device_count=jax.device_count())}


def tensor_parallel_report() -> dict:
    """tp2 beside the data parallelism, each tensor-parallel rank passing rows of its own (SMP's default): the
    gradients of one step, and the all-reduce bytes in the loop and after it, with the gradients kept per replica
    through the loop and, compiled for another model, reduced per microbatch."""
    smp.init({"microbatches": 2, "ddp": True, "tensor_parallel_degree": 2})
    images, labels = (t.chunk(smp.dp_size())[smp.dp_rank()] for t in batch())
    report = {}
    for kept in (True, False):
        with gradient_reduction.replica_copies(kept):
            model = smp.DistributedModel(net())
            hlo = train_step.lower(model, images, labels).compile().as_text()
        report["all_reduce_bytes" if kept else "all_reduce_bytes_per_microbatch"] = all_reduce_bytes(
            hlo, device_count=jax.device_count()
        )
        if kept:
            train_step(model, images, labels)
            grads = named_grads(multihost_utils.process_allgather(model.grads, tiled=True))  # tp-split across processes
            report["grads"] = {name: g.tolist() for name, g in grads.items()}
    return report


if __name__ == "__main__":
    smp.init({"microbatches": 2, "ddp": True, "scan_layers": True})
    model = smp.DistributedModel(net())
    images, labels = (t.chunk(smp.dp_size())[smp.dp_rank()] for t in batch())
    train_step(model, images, labels)
    grads = {name: g.tolist() for name, g in named_grads(model.grads).items()}
    hlo = train_step.lower(model, images, labels).compile().as_text()
    report = {"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "grads": grads}
    report["stacked"] = type(model.store).__name__ == "StackStore"
    report["fp8"] = {microbatches: fp8_steps(int(sys.argv[2]), microbatches) for microbatches in (1, 2)}
    report["tp2"] = tensor_parallel_report()
    report["all_reduce_bytes"] = all_reduce_bytes(hlo, device_count=jax.device_count())  # over any group
    (Path(sys.argv[1]) / f"report_{smp.rank()}.json").write_text(json.dumps(report))
