"""Fault tolerance: from a worker's death to training again, and what periodic async checkpoints cost a step.

    python -m benchmarks.fault_tolerance [--size small|124M] [--out benchmarks/results/fault_tolerance.json]

GPT-2 (Hugging Face, from a config, random weights) under ``sharded_data_parallel_degree=8`` over 2 processes
x 4 emulated CPU devices (``python -m jmp.launch -n 2 --cpu-devices 4``), AdamW, each process a batch of
4 x 64 tokens. ``small``: 2 layers, d_model 128, 4 heads, vocab 1024; ``124M``: GPT-2 small's own size.

Recovery
    ``--max-restarts 1`` with the launcher's default ``--grace``; a partial checkpoint after every step. After
    step ``KILL_AFTER``'s checkpoint is complete, rank 1 SIGKILLs itself while rank 0 goes on into a barrier
    (inside JAX's runtime, which catches SIGTERM). Timestamps (wall clock, one machine): the death (printed just
    before the kill), the launcher's line naming the dead rank (detection), its restart line (the others
    stopped), and in the restarted processes: started (interpreter up, before importing torch / JAX / jmp),
    imported, ``smp.init`` done, model and optimizer built, ``resume_from_checkpoint`` done, first step done.

Periodic checkpoints
    In one run without failures, blocks of ``EVERY`` steps alternate: without a checkpoint, and with
    ``smp.save_checkpoint`` (partial, async) at the block's first step; the step time of each block is its wall
    time over ``EVERY`` (the write goes on in the background during the block's other steps, competing for the
    same 2 CPU cores). ``REPEATS`` blocks of each kind, medians.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports below: a restarted process's start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

SIZES = {
    "124M": dict(vocab=50257, positions=1024, d_model=768, layers=12, heads=12),
    "small": dict(vocab=1024, positions=1024, d_model=128, layers=2, heads=4),
}
BATCH, SEQUENCE = 4, 64
KILL_AFTER, STEPS_AFTER_RESTART = 3, 2
EVERY, REPEATS = 10, 3
ROOT = Path(__file__).resolve().parents[1]


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


# --- the launched processes ---------------------------------------------------------------------------------------


def worker(mode: str, directory: str, size: str) -> None:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    _emit("started", rank=rank, attempt=attempt, t=STARTED)
    import jax
    import torch

    import jmp as smp
    from benchmarks.harness import causal_lm, gpt2_config, lm_step, token_ids

    _emit("imported", rank=rank, attempt=attempt)
    smp.init({"sharded_data_parallel_degree": 8})
    _emit("initialised", rank=rank, attempt=attempt)
    spec = gpt2_config(**SIZES[size])
    model = smp.DistributedModel(causal_lm(spec))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    _emit("built", rank=rank, attempt=attempt)

    def train(step: int) -> None:
        optimizer.zero_grad()
        lm_step(model, token_ids(BATCH, SEQUENCE, SIZES[size]["vocab"], seed=1000 * step + rank))
        optimizer.step()

    def synchronised() -> None:
        jax.block_until_ready(model.training_state.params)

    if mode == "failure":
        first = 0
        if attempt > 0:
            first = smp.resume_from_checkpoint(directory)["next_step"]
            _emit("resumed", rank=rank, attempt=attempt, step=first)
        last = KILL_AFTER if attempt == 0 else first + STEPS_AFTER_RESTART
        for step in range(first, last):
            train(step)
            synchronised()
            _emit("step", rank=rank, attempt=attempt, step=step)
            smp.save_checkpoint(directory, f"step{step + 1}", model=model, optimizer=optimizer,
                                user_content={"next_step": step + 1})  # fmt: skip
        if attempt == 0:
            smp.saving.wait_for_saves()
            smp.barrier()
            if rank == 1:
                _emit("dying", rank=rank, attempt=attempt)
                os.kill(os.getpid(), signal.SIGKILL)
            smp.barrier()
    else:
        for step in range(2):  # compiled, warm
            train(step)
        synchronised()
        for repeat in range(REPEATS):
            for saving in (False, True):
                begin = time.perf_counter()
                for step in range(EVERY):
                    if saving and step == 0:
                        smp.save_checkpoint(directory, f"r{repeat}", model=model, optimizer=optimizer)
                    train(step)
                synchronised()
                _emit("block", rank=rank, saving=saving, step_s=(time.perf_counter() - begin) / EVERY)
                smp.saving.wait_for_saves()  # each block with a save holds exactly one


# --- the driver ---------------------------------------------------------------------------------------------------


def _launch(mode: str, directory: str, size: str, restarts: int) -> tuple[list[dict], list[tuple[float, str]], int]:
    """Run the workers under jmp.launch; (their events, the launcher's lines with the time each arrived, code)."""
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--cpu-devices", "4", "--max-restarts", str(restarts)]
    command += ["-m", "benchmarks.fault_tolerance", "--worker", mode, directory, "--size", size]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events, launcher = [], []

    def read_errors() -> None:
        for line in process.stderr:
            if line.startswith("jmp.launch:"):
                launcher.append((time.time(), line.strip()))
            elif "Traceback" in line or "Error" in line:
                sys.stderr.write(line)

    reader = threading.Thread(target=read_errors, daemon=True)
    reader.start()
    for line in process.stdout:
        if line.startswith('{"event"'):
            events.append(json.loads(line))
    code = process.wait()
    reader.join()
    return events, launcher, code


def recovery(size: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="jmp-fault-tolerance-") as directory:
        events, launcher, code = _launch("failure", directory, size, restarts=1)
    if code != 0:
        raise SystemExit(f"the failure run ended with {code}: {launcher}")
    death = next(e["t"] for e in events if e["event"] == "dying")
    detected = next(t for t, line in launcher if "was killed by SIGKILL" in line)
    restarted = next(t for t, line in launcher if "restart 1 of 1" in line)

    def latest(event: str) -> float:  # the slower process decides when training goes on
        return max(e["t"] for e in events if e["event"] == event and e.get("attempt") == 1)

    again = min(e["t"] for e in events if e["event"] == "step" and e.get("attempt") == 1)
    phases = {
        "detection_s": detected - death,
        "stopping_the_others_s": restarted - detected,
        "process_start_s": latest("started") - restarted,
        "imports_s": latest("imported") - latest("started"),
        "smp_init_s": latest("initialised") - latest("imported"),
        "build_model_and_optimizer_s": latest("built") - latest("initialised"),
        "resume_from_checkpoint_s": latest("resumed") - latest("built"),
        "first_step_s": again - latest("resumed"),
    }
    return {"death_to_training_again_s": again - death, "phases": phases, "launcher": [line for _, line in launcher]}


def periodic(size: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="jmp-fault-tolerance-") as directory:
        events, launcher, code = _launch("periodic", directory, size, restarts=0)
    if code != 0:
        raise SystemExit(f"the periodic-checkpoint run ended with {code}: {launcher}")
    blocks = [e for e in events if e["event"] == "block"]
    plain = statistics.median(e["step_s"] for e in blocks if not e["saving"])
    saving = statistics.median(e["step_s"] for e in blocks if e["saving"])
    return {
        "every_steps": EVERY,
        "step_s_without_checkpoints": plain,
        "step_s_with_a_checkpoint_every_block": saving,
        "cost_per_step": saving / plain - 1,
        "samples": blocks,
    }


def notes(result: dict) -> list[str]:
    """What the numbers say, in words."""
    recovery, periodic = result["recovery"], result["periodic_checkpoints"]
    phases = recovery["phases"]
    restart = sum(v for k, v in phases.items() if k not in ("detection_s", "stopping_the_others_s"))
    return [
        f"from rank 1's SIGKILL to the restarted processes' first step: {recovery['death_to_training_again_s']:.1f} s. "
        f"The launcher saw the death after {phases['detection_s']:.2f} s (its child; JAX's heartbeat would take "
        f"60 s) and had the other process stopped {phases['stopping_the_others_s']:.1f} s later: --grace's "
        "SIGKILL, since a process in JAX's runtime catches SIGTERM. Starting again took "
        f"{restart:.1f} s: imports {phases['imports_s']:.1f} s, smp.init {phases['smp_init_s']:.1f} s, "
        f"building the model and optimizer {phases['build_model_and_optimizer_s']:.1f} s, resume "
        f"{phases['resume_from_checkpoint_s']:.2f} s, the first step {phases['first_step_s']:.1f} s (tracing, and "
        "compiling or loading from jmp's persistent compilation cache).",
        f"an async partial checkpoint every {periodic['every_steps']} steps: "
        f"{periodic['step_s_with_a_checkpoint_every_block']:.3f} s per step against "
        f"{periodic['step_s_without_checkpoints']:.3f} s without ({periodic['cost_per_step']:+.1%}), the save's "
        "blocking part and Orbax's background writing sharing the same 2 CPU cores with the training.",
        "2-core machine shared with other jobs (load average about 9 during this run): timings vary between runs.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/fault_tolerance.json")
    options = parser.parse_args()
    if options.worker:
        worker(*options.worker, options.size)
        return
    from benchmarks.harness import machine, write_results

    result = {
        "what": __doc__.splitlines()[0],
        "machine": machine() | {"processes": 2, "devices_per_process": 4},
        "config": {
            "size": options.size,
            **SIZES[options.size],
            "batch_per_process": BATCH,
            "sequence": SEQUENCE,
            "layout": "sharded_data_parallel_degree=8",
            "kill_after_step": KILL_AFTER,
        },  # fmt: skip
        "recovery": recovery(options.size),
        "periodic_checkpoints": periodic(options.size),
    }
    result["notes"] = notes(result)
    write_results(options.out, result)
    print(json.dumps({k: result[k] for k in ("recovery", "periodic_checkpoints")}, indent=2, default=str)[:4000])


if __name__ == "__main__":
    main()
