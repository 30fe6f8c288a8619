"""A script that ``tests/multiprocess/test_restarts.py`` runs under ``python -m jmp.launch --max-restarts N``.

Every process prints one JSON line with its rank, pid and torchrun's restart variables first. MODE one of:

- ``fail-once`` (no JAX): on the first attempt rank 1 kills itself (SIGKILL) and the others wait to be stopped;
  on a restart every process exits 0.
- ``fail-always`` (no JAX): rank 1 exits with code 3 on every attempt, the others wait.
- ``train DIR``: train a small model for ``STEPS`` steps, a partial checkpoint in DIR after each, resuming from
  DIR's newest one when it has one; on the first attempt rank 1 kills itself (SIGKILL) right after step
  ``KILLED_AFTER``'s save, while the others wait for it in a barrier. The attempt that completes then trains
  the same model from the same seed uninterrupted, in the same processes and layout, and prints both runs'
  losses and final parameters (hex).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

STEPS = 3
KILLED_AFTER = 1  # the step whose checkpoint the killed attempt leaves


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def started() -> tuple[int, int]:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    emit(
        {
            "rank": rank,
            "pid": os.getpid(),
            "restart_count": attempt,
            "max_restarts": int(os.environ["TORCHELASTIC_MAX_RESTARTS"]),
        }
    )
    return rank, attempt


def wait_to_be_stopped() -> None:
    time.sleep(120)
    raise SystemExit("was not stopped")


def train(root: str, rank: int, attempt: int) -> None:
    import torch

    import jmp as smp

    @smp.step
    def train_step(model, data, target):
        loss = torch.nn.functional.mse_loss(model(data), target)
        model.backward(loss)
        return loss

    def build() -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
        torch.manual_seed(0)
        model = smp.DistributedModel(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        )
        return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * step + smp.rank())
        return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)

    def one_step(model, optimizer, step: int) -> str:
        optimizer.zero_grad()
        loss = train_step(model, *batch(step)).reduce_mean()
        optimizer.step()
        return float(loss).hex()

    def parameters(model) -> dict[str, list[str]]:
        return {name: [float(x).hex() for x in value.flatten()] for name, value in model.state_dict().items()}

    smp.init({})
    model, optimizer = build()
    first = 0
    if os.path.exists(os.path.join(root, "newest")):
        first = smp.resume_from_checkpoint(root)["next_step"]
    losses = {}
    for step in range(first, STEPS):
        losses[step] = one_step(model, optimizer, step)
        smp.save_checkpoint(
            root, f"step{step + 1}", model=model, optimizer=optimizer, user_content={"next_step": step + 1}
        )
        if attempt == 0 and step + 1 == KILLED_AFTER:
            smp.saving.wait_for_saves()
            smp.barrier()  # the checkpoint is complete on every process
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            smp.barrier()  # waits for the dead process, inside JAX's runtime, until the launcher stops it
            raise SystemExit("the barrier returned without rank 1")
    resumed = {"first_step": first, "losses": losses, "parameters": parameters(model)}
    model, optimizer = build()
    uninterrupted = {"losses": {step: one_step(model, optimizer, step) for step in range(STEPS)}}
    emit({"rank": rank, "resumed": resumed, "uninterrupted": uninterrupted | {"parameters": parameters(model)}})


def main(mode: str, *args: str) -> None:
    rank, attempt = started()
    if mode == "fail-once":
        if attempt == 0:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            wait_to_be_stopped()
    elif mode == "fail-always":
        if rank == 1:
            raise SystemExit(3)
        wait_to_be_stopped()
    else:
        train(*args, rank, attempt)


if __name__ == "__main__":
    main(*sys.argv[1:])
