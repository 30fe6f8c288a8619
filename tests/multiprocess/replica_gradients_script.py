"""Two processes, each with the devices ``jmp.launch`` gives it, data parallel with 2 microbatches: each
replica's gradients are kept through the microbatch loop and reduced once after it. Prints, per process, its
ranks, the gradients of one step by torch name, whether the model's layer list is stored stacked, and the bytes
of the all-reduces inside the compiled step's loop and outside it, as JSON in ``report_<rank>.json`` in the
directory given (lines this long printed by both processes can interleave)."""

import json
import sys
from pathlib import Path

import jax
import torch.nn.functional as F

import jmp as smp
from benchmarks.harness import all_reduce_bytes, named_grads
from tests.multiprocess.replica_gradients_model import batch, net


@smp.step
def train_step(model, images, labels):
    loss = F.nll_loss(model(images), labels)
    model.backward(loss)
    return loss


if __name__ == "__main__":
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}  # more config keys, for runs by hand
    smp.init({"microbatches": 2, "ddp": True, "scan_layers": True, **extra})
    model = smp.DistributedModel(net())
    images, labels = (t.chunk(smp.dp_size())[smp.dp_rank()] for t in batch())
    train_step(model, images, labels)
    grads = {name: g.tolist() for name, g in named_grads(model.grads).items()}
    hlo = train_step.lower(model, images, labels).compile().as_text()
    report = {"rank": smp.rank(), "dp": [smp.dp_rank(), smp.dp_size()], "grads": grads}
    report["stacked"] = type(model.store).__name__ == "StackStore"
    report["all_reduce_bytes"] = all_reduce_bytes(hlo, device_count=jax.device_count())  # over any group
    (Path(sys.argv[1]) / f"report_{smp.rank()}.json").write_text(json.dumps(report))
