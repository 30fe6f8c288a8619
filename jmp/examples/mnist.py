"""The seed script, run with ``import jmp as smp``: GroupedNet on MNIST-shaped digits, pipelined.

    python -m jmp.examples.mnist [--epochs 3] [--batch-size 64] [--microbatches 4] [--partitions 2]

SageMaker's example's settings: Adadelta (lr 4.0), ``drop_last=True``, automatic partitioning into
``--partitions`` stages, interleaved microbatches, data parallelism over the remaining devices. Under
``python -m jmp.launch -n N`` ``--batch-size`` is per process and the held-out metrics are summed with
``smp.allgather``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

# JAX reads XLA_FLAGS when it first creates its CPU backend, which has not happened yet
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jmp as smp  # noqa: E402
from jmp.examples.data import ProcessShare, digits  # noqa: E402
from jmp.examples.models import GroupedNet  # noqa: E402


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


@smp.step
def eval_step(model, data, target):
    output = model(data)
    # per digit: each process sums the rows it fed (SMP's per-rank outputs), then the processes add their sums
    return F.nll_loss(output, target, reduction="none"), output.argmax(dim=1) == target


def train(model, train_loader, optimizer, epoch: int, epochs: int) -> float:
    model.train()
    total, start = 0.0, time.perf_counter()
    for batch_idx, (data, target) in enumerate(train_loader, 1):
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()  # average the loss across microbatches
        optimizer.step()
        total += float(loss)
        _progress(epoch, epochs, batch_idx, len(train_loader), total / batch_idx, time.perf_counter() - start)
    return total / len(train_loader)


def evaluate(model, test_loader) -> tuple[float, float]:
    """(mean loss, accuracy) over the held-out digits of every data-parallel process."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        loss_mb, correct_mb = eval_step(model, data, target)
        loss += float(loss_mb.concat().sum())
        correct += int(correct_mb.concat().sum())
        count += len(target)
    totals = smp.allgather((loss, correct, count), smp.DP_GROUP)  # [(loss, correct, count)] per process
    loss, correct, count = (sum(column) for column in zip(*totals))
    return loss / count, correct / count


def _progress(epoch, epochs, done, steps, loss, seconds):
    if smp.rank() != 0 or (done != steps and not sys.stdout.isatty()):
        return  # the job's report, once per job; in a log, one line per epoch
    filled = int(20 * done / steps)
    end = "\n" if done == steps else ""
    sys.stdout.write(
        f"\repoch {epoch}/{epochs} [{'#' * filled}{'.' * (20 - filled)}] {done}/{steps} "
        f"loss {loss:.4f} ({seconds:.1f}s){end}"
    )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process, as SMP's per-rank batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=2, help="pipeline stages (1: data parallel only)")
    args = parser.parse_args(argv)
    # jmp's INFO lines (what compiling took); force: a library imported above put a handler on the root logger
    logging.basicConfig(format="%(message)s", force=True)
    logging.getLogger("jmp").setLevel(logging.INFO)

    smp.init(
        {
            "partitions": args.partitions,
            "microbatches": args.microbatches,
            "pipeline": "interleaved",
            "auto_partition": True,
            "ddp": True,
        }
    )
    torch.manual_seed(smp.get_config().random_seed)
    train_images, train_labels, test_images, test_labels = digits()
    # one process feeds the whole batch; with several, each feeds its block of every global batch (SMP's per-rank
    # batch): N processes with --batch-size B train on what one process with --batch-size N x B does
    rank, processes = smp.dp_rank(), smp.dp_size()
    seed = smp.get_config().random_seed
    train_loader = DataLoader(
        TensorDataset(train_images, train_labels),
        batch_sampler=ProcessShare(len(train_labels), args.batch_size, rank, processes, shuffle=True, seed=seed),
    )
    test_loader = DataLoader(
        TensorDataset(test_images, test_labels),
        batch_sampler=ProcessShare(len(test_labels), args.batch_size, rank, processes, shuffle=False),
    )

    model = GroupedNet()
    optimizer = optim.Adadelta(model.parameters(), lr=4.0)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    mesh = dict(smp.get_mesh().shape)
    report = print if smp.rank() == 0 else lambda *args: None  # once per job, not once per process
    report(
        f"GroupedNet on {len(train_labels)} digits; mesh {mesh}: {args.partitions} pipeline stage(s), "
        f"{args.microbatches} microbatches per step"
    )

    for epoch in range(1, args.epochs + 1):
        train(model, train_loader, optimizer, epoch, args.epochs)
        test_loss, accuracy = evaluate(model, test_loader)
        report(f"  held-out: loss {test_loss:.4f}, accuracy {accuracy:.2%}")
    return accuracy


if __name__ == "__main__":
    main()
