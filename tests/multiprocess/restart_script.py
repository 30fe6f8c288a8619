"""A script that ``tests/multiprocess/test_restarts.py`` runs under ``python -m jmp.launch --max-restarts N``.

Every process prints one JSON line with its rank, pid and torchrun's restart variables first. MODE one of:

- ``fail-once`` (no JAX): on the first attempt rank 1 kills itself (SIGKILL) and the others wait to be stopped;
  on a restart every process exits 0.
- ``fail-always`` (no JAX): rank 1 exits with code 3 on every attempt, the others wait.
- ``fail-connecting N``: every process calls ``smp.init()``; on the first N attempts rank 1's JAX runtime fails to
  start there (``jax.distributed.initialize`` raises gloo's start-up error), as it can on a loaded machine.
- ``hang`` (jmp's ``runtime/step_boundary.py`` loaded alone, no JAX): each process finishes a first step
  (``step_boundary.step_ended``), then rank 1 stops itself (SIGSTOP) and the others wait in
  ``wait_in_a_collective``.
- ``train DIR`` (under ``--max-restarts 1 --preemption-checkpoint-dir DIR``): train a small model for ``STEPS``
  steps, a partial checkpoint in DIR after each, every step's loss printed before its update. The first attempt:
  rank 1 kills itself (SIGKILL) after step ``KILLED_AFTER``'s save while the others wait for it in a barrier.
  The restart first trains the same model from the same seed uninterrupted, in the same processes and layout,
  and prints its losses and final parameters (hex); then it resumes from DIR's newest checkpoint and trains on;
  after step ``PREEMPTED_AFTER``'s save rank 1 sends the launcher SIGTERM, and every process saves the
  preemption checkpoint at the end of the next step (the last) and exits 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

STEPS = 3
KILLED_AFTER = 1  # the step whose checkpoint the killed attempt leaves
PREEMPTED_AFTER = 2  # the step after which the launcher gets SIGTERM on the restart


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


def jmp_step_boundary():
    """``jmp.runtime.step_boundary`` (standard library only) without importing the jmp package (torch, JAX)."""
    path = Path(__file__).resolve().parents[2] / "jmp" / "runtime" / "step_boundary.py"
    spec = importlib.util.spec_from_file_location("step_boundary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_in_a_collective() -> None:
    """Where a hung step's stack dump shows the process waiting."""
    time.sleep(120)
    raise SystemExit("was not stopped")


def wait_to_be_stopped() -> None:
    time.sleep(120)
    raise SystemExit("was not stopped")


def tiny_model():
    """The trained model (torch seed 0), and its Adam optimizer's settings."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def build():
    import torch

    import jmp as smp

    model = smp.DistributedModel(tiny_model())
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))


def parameters(model) -> dict[str, list[str]]:
    return {name: [float(x).hex() for x in value.flatten()] for name, value in model.state_dict().items()}


def train(root: str, rank: int, attempt: int) -> None:
    import torch

    import jmp as smp

    @smp.step
    def train_step(model, data, target):
        loss = torch.nn.functional.mse_loss(model(data), target)
        model.backward(loss)
        return loss

    def loss_of_step(model, optimizer, step: int) -> str:
        generator = torch.Generator().manual_seed(1000 * step + smp.rank())  # each process its own rows
        optimizer.zero_grad()
        data, target = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        return float(train_step(model, data, target).reduce_mean()).hex()

    smp.init({})
    first_start = not os.path.exists(os.path.join(root, "newest"))
    if not first_start:  # the uninterrupted run, in the same processes and layout
        model, optimizer = build()
        losses = {}
        for step in range(STEPS):
            losses[step] = loss_of_step(model, optimizer, step)
            optimizer.step()
        emit({"rank": rank, "uninterrupted": {"losses": losses, "parameters": parameters(model)}})
    model, optimizer = build()
    first = 0 if first_start else smp.resume_from_checkpoint(root, model=model)["next_step"]
    emit({"rank": rank, "attempt": attempt, "first_step": first})
    step = first
    smp.set_preemption_user_content(lambda: {"next_step": step + 1})
    for step in range(first, STEPS):
        emit({"rank": rank, "step": step, "loss": loss_of_step(model, optimizer, step)})
        optimizer.step()  # the step the preemption checkpoint is taken after
        smp.save_checkpoint(
            root, f"step{step + 1}", model=model, optimizer=optimizer, user_content={"next_step": step + 1}
        )
        if first_start and step + 1 == KILLED_AFTER:
            smp.saving.wait_for_saves()
            smp.barrier()  # the checkpoint is complete on every process
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            smp.barrier()  # waits for the dead process, inside JAX's runtime, until the launcher stops it
            raise SystemExit("the barrier returned without rank 1")
        if step + 1 == PREEMPTED_AFTER:
            if rank == 1:
                os.kill(os.getppid(), signal.SIGTERM)  # the launcher passes it on to every process
            smp.barrier()
            time.sleep(2)  # JAX's preemption notice reaches every process: the next step ends at the sync point
    raise SystemExit("the run was not preempted")


def main(mode: str, *args: str) -> None:
    rank, attempt = started()
    if mode == "fail-once":
        if attempt == 0:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            wait_to_be_stopped()
    elif mode == "hang":
        step_boundary = jmp_step_boundary()  # under --step-timeout: dumps stacks on SIGUSR1, notes each step
        step_boundary.step_ended(None)  # what the optimizer calls after its update: the first step is done
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        wait_in_a_collective()
    elif mode == "fail-always":
        if rank == 1:
            raise SystemExit(3)
        wait_to_be_stopped()
    elif mode == "fail-connecting":
        import jax

        import jmp as smp

        if rank == 1 and attempt < int(args[0]):

            def fails_to_connect(*args, **kwargs):
                raise RuntimeError("Gloo context initialization failed: Connect timeout (as on a loaded machine)")

            jax.distributed.initialize = fails_to_connect
        smp.init({})
        emit({"rank": rank, "connected": smp.size()})
    else:
        train(*args, rank, attempt)


if __name__ == "__main__":
    main(*sys.argv[1:])
