"""PyTorch's own torchrun DDP examples under ``python -m jmp.launch``, with no edit, against PyTorch's DDP on gloo.

    python -m benchmarks.ddp_examples --examples DIR [--only NAME ...] [--out benchmarks/results/ddp_examples.json]

The scripts are not in this repository: DIR is a checkout of pytorch/examples made outside it (``git clone
https://github.com/pytorch/examples DIR``, or ``git archive`` of one unpacked), from which ``distributed/ddp/`` and
``distributed/ddp-tutorial-series/`` are read at the commit measured, each file checked against its recorded blob
(``benchmarks/aws_scripts/checkout.py``). Without ``--examples`` this says how to get them and stops (exit 0).

Each configuration runs one script twice through ``benchmarks/ddp_host.py`` (what a CPU host lacks for a GPU
script, and the record of losses and final weights), each in a fresh folder: under ``torchrun --nproc-per-node P``
(PyTorch's ``DistributedDataParallel`` on gloo: the reference) and under ``python -m jmp.launch -n P`` (the
script's ``DistributedDataParallel`` is jmp's). Both seed torch with the rank, so the data and initial weights
are the same draws. Compared: every process's losses and process 0's final weights, within float32 error (1e-5
relative: a handful of roundings of sums in another order).

- ``example``: ``distributed/ddp/example.py``: a two-layer net, one SGD step of an MSE loss on each process's own
  random rows (the gradient is the mean of the processes').
- ``example_2dev``: the same with each jmp process driving 2 CPU devices (its rows split over them).
- ``tutorial``: ``distributed/ddp-tutorial-series/multigpu_torchrun.py 3 1`` (3 epochs, a snapshot each):
  ``DistributedSampler``, ``DataLoader``, the optimizer built before the model is wrapped, ``model.module``'s
  state dict saved. Its loss is ``F.cross_entropy`` of one output column against a float target, a
  probability over one class, so it is 0 for every row and the weights do not move: the run checks the script
  runs through and every process ends with process 0's weights, not training numerics (``example`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.aws_scripts import checkout
from benchmarks.script_runs import jmp_tree

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "ddp_examples.json"
ORIGIN = "https://github.com/pytorch/examples"
EXAMPLES = checkout.Scripts(
    what="PyTorch's DDP examples (distributed/ddp/, distributed/ddp-tutorial-series/)",
    commit="77f55b912142e11fcfdf5b530231fb9c52f181e8",  # 2025-08-25
    folder="distributed",
    blobs={
        "ddp/example.py": "d64b4739769e3c36cc5522605edd43582895b59b",
        "ddp-tutorial-series/multigpu_torchrun.py": "32d6254d2dc43b104655bb7aec41a00b492e8dc4",
        "ddp-tutorial-series/datautils.py": "22c364eaa0d36bdcb5726f9f23972fe6b5d50615",
    },
)
CONFIGS = {  # name -> (script, its arguments, processes, CPU devices per jmp process)
    "example": ("ddp/example.py", [], 2, 1),
    "example_2dev": ("ddp/example.py", [], 2, 2),
    "tutorial": ("ddp-tutorial-series/multigpu_torchrun.py", ["3", "1"], 2, 1),
}
RTOL, ATOL = 1e-5, 1e-7


def launch(runner: str, script: Path, args: list[str], processes: int, devices: int, work: Path) -> dict:
    """Run ``script`` under ``runner`` ("torchrun" or "jmp") in ``work``; what it did and each process's report."""
    host = [str(ROOT / "benchmarks" / "ddp_host.py"), str(work), str(script), *args]
    if runner == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", *host]
    else:
        command = [sys.executable, "-m", "jmp.launch", "-n", str(processes), "--cpu-devices", str(devices), *host]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    record = {"returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode != 0:
        record["stderr_tail"] = done.stderr[-3000:]
    reports = [json.loads((work / f"rank{r}.json").read_text()) for r in range(processes)]
    return record | {"reports": reports, "stdout_lines": len(done.stdout.splitlines())}


def compare(jmp: list[dict], torch_runs: list[dict]) -> dict:
    """Largest gaps of the losses (every process) and of process 0's final weights, and whether within tolerance."""
    loss_gap = max(
        (abs(a - b) for ours, theirs in zip(jmp, torch_runs) for a, b in zip(ours["losses"], theirs["losses"])),
        default=0.0,
    )
    same_counts = all(len(a["losses"]) == len(b["losses"]) for a, b in zip(jmp, torch_runs))
    weight_gap = 0.0
    for name, value in torch_runs[0]["weights"].items():
        ours = np.asarray(jmp[0]["weights"][name])
        weight_gap = max(weight_gap, float(np.max(np.abs(ours - np.asarray(value)))))
    within = same_counts and jmp[0]["weights"].keys() == torch_runs[0]["weights"].keys()
    for ours, theirs in zip(jmp, torch_runs):
        within = within and np.allclose(ours["losses"], theirs["losses"], rtol=RTOL, atol=ATOL)
    for name, value in torch_runs[0]["weights"].items():
        within = within and np.allclose(jmp[0]["weights"][name], value, rtol=RTOL, atol=ATOL)
    update = max(
        float(np.max(np.abs(np.asarray(value) - np.asarray(torch_runs[0]["initial_weights"][name]))))
        for name, value in torch_runs[0]["weights"].items()
    )
    return {
        "ddp_classes": [jmp[0]["ddp"], torch_runs[0]["ddp"]],
        "max_weight_update_pytorch": update,  # how far training moved the weights: the gap is measured against it
        "losses_per_process": len(jmp[0]["losses"]),
        "max_loss_gap": loss_gap,
        "max_weight_gap": weight_gap,
        "processes_agree": all(r["weights"] == jmp[0]["weights"] for r in jmp),
        "within_tolerance": bool(within),
    }


def run_config(name: str, folder: Path, tmp: Path) -> dict:
    script, args, processes, devices = CONFIGS[name]
    record: dict = {"script": script, "args": args, "processes": processes, "jmp_devices_per_process": devices}
    runs = {}
    for runner in ("torchrun", "jmp"):
        work = tmp / f"{name}-{runner}"
        work.mkdir()
        try:
            runs[runner] = launch(runner, folder / script, args, processes, devices, work)
        except (FileNotFoundError, subprocess.TimeoutExpired) as error:
            record[runner] = {"error": repr(error)}
            return record
        record[runner] = {k: v for k, v in runs[runner].items() if k != "reports"}
    record["first_losses"] = {r: runs[r]["reports"][0]["losses"][:4] for r in runs}
    record["comparison"] = compare(runs["jmp"]["reports"], runs["torchrun"]["reports"])
    return record


def how_to_get() -> str:
    return "\n".join(
        [
            f"benchmarks.ddp_examples: {EXAMPLES.what} are not in this repository. They run from a checkout",
            f"of {ORIGIN} made outside it, named by path:",
            f"    git clone {ORIGIN} DIR",
            "    python -m benchmarks.ddp_examples --examples DIR",
            f"It reads, at commit {EXAMPLES.commit}, under {EXAMPLES.folder!r}: {', '.join(sorted(EXAMPLES.blobs))}",
            "Skipped: no --examples DIR.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=Path, default=None, help="a checkout of pytorch/examples")
    parser.add_argument("--only", nargs="*", default=None, help=f"configuration names, of {list(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    if options.examples is None:
        print(how_to_get())
        return
    names = options.only or list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"no configuration {unknown}; there are {list(CONFIGS)}")
    results: dict = {"configurations": {}}
    with tempfile.TemporaryDirectory(prefix="ddp-examples-") as tmp:
        try:
            folder = checkout.materialise(options.examples, EXAMPLES, Path(tmp) / "examples")
        except checkout.CheckoutError as error:
            parser.error(str(error))
        for name in names:  # one at a time: each runs its processes on every core
            record = run_config(name, folder, Path(tmp))
            results["configurations"][name] = record
            print(name, json.dumps(record.get("comparison", record)), flush=True)
    results["scripts"] = {"origin": ORIGIN, "commit": EXAMPLES.commit, "folder": EXAMPLES.folder}
    results["tolerance"] = {"rtol": RTOL, "atol": ATOL}
    results["jmp_tree"] = jmp_tree()
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
