"""nanoGPT's ``train.py`` (github.com/karpathy/nanoGPT, a single-file GPT training script nobody here wrote) run
with the three lines a user adds, against the same script in plain PyTorch.

The script is read from a checkout given by path (``--nanogpt DIR``: ``git clone https://github.com/karpathy/nanoGPT
DIR``), at the commit recorded here, each file checked against its git blob hash; nothing of it is in this
repository. Into a copy in a temporary folder the runner adds ``import jmp as smp`` after ``import torch`` and,
after ``model.to(device)``, ``smp.init({...})`` and ``model = smp.DistributedModel(model)``: nothing else changes.
The script then calls ``model.configure_optimizers(...)`` and ``raw_model.estimate_mfu(...)`` on the wrapped model
(the user's methods, ``self`` the distributed model), ``torch.compile(model)`` (``--compile=True``: jmp gives the
model back), trains with gradient accumulation, ``clip_grad_norm_`` and a disabled ``GradScaler``, evaluates under
``torch.no_grad()`` and saves ``model.state_dict()`` / ``optimizer.state_dict()``. The reference is the unedited
script in PyTorch (``--compile=False``: inductor needs a C compiler), on the same synthetic token data.

Reported per configuration: every logged training loss (4 decimals, as the script prints them) and evaluation
loss, their largest difference from PyTorch's, and the largest difference of the saved weights.

    python -m benchmarks.nanogpt_script --nanogpt /path/to/nanoGPT [--configs dp8 sdp8 tp2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.script_runs import ROOT, launch

COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"  # nanoGPT's master, 2025
BLOBS = {
    "train.py": "de5785051050d64bbda37a4964c2c079f0739b2b",
    "model.py": "c698f8b60129d793494de058b0dd4e318c0dcb5e",
    "configurator.py": "a8bba9599537cbb34b378399a077b525a87d497f",
}
CONFIGS = {
    "dp8": {},
    "sdp8": {"sharded_data_parallel_degree": 8},
    "tp2": {"tensor_parallel_degree": 2},
}
VOCAB = 64
ARGS = [  # a small GPT on CPU; 2-step gradient accumulation, clipping, an evaluation and a checkpoint at iter 10
    "--dataset=tiny", "--device=cpu", "--dtype=float32", "--batch_size=8", "--block_size=32",
    "--n_layer=2", "--n_head=2", "--n_embd=64", "--dropout=0.0", "--bias=False",
    "--gradient_accumulation_steps=2", "--max_iters=20", "--lr_decay_iters=20", "--warmup_iters=2",
    "--learning_rate=1e-3", "--min_lr=1e-4", "--eval_interval=10", "--eval_iters=2", "--log_interval=1",
    "--grad_clip=1.0", "--wandb_log=False", "--out_dir=out",
]  # fmt: skip
_ITER = re.compile(r"^iter (\d+): loss ([0-9.]+)", re.MULTILINE)
_EVAL = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)", re.MULTILINE)


def read_scripts(checkout: Path) -> dict[str, bytes]:
    """The files at ``COMMIT`` (git) or as they are in ``checkout``, each the blob recorded in ``BLOBS``."""
    files = {}
    for name, blob in BLOBS.items():
        if (checkout / ".git").exists() or (checkout / "HEAD").exists():  # a clone, or a bare git directory
            show = ["git", "--git-dir", str(_git_dir(checkout)), "show", f"{COMMIT}:{name}"]
            data = subprocess.run(show, capture_output=True, check=True).stdout
        else:
            data = (checkout / name).read_bytes()
        found = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        if found != blob:
            raise SystemExit(f"{checkout}/{name} is blob {found}, not nanoGPT {COMMIT[:8]}'s {blob}")
        files[name] = data
    return files


def _git_dir(checkout: Path) -> Path:
    return checkout / ".git" if (checkout / ".git").exists() else checkout


def with_three_lines(train: str, config: dict) -> str:
    """``train.py`` with the three lines a user adds; refuses if the anchors moved."""
    lines = train.splitlines()
    if lines.count("import torch") != 1 or lines.count("model.to(device)") != 1:
        raise SystemExit("train.py: 'import torch' / 'model.to(device)' not found once each")
    at = lines.index("import torch")
    lines.insert(at + 1, "import jmp as smp")
    at = lines.index("model.to(device)")
    lines[at + 1 : at + 1] = [f"smp.init({config!r})", "model = smp.DistributedModel(model)"]
    return "\n".join(lines) + "\n"


def write_data(folder: Path) -> None:
    """``data/tiny``: token sequences with structure to learn (each token the previous plus a small step)."""
    rng = np.random.default_rng(0)
    data = folder / "data" / "tiny"
    data.mkdir(parents=True)
    for split, count in (("train", 20000), ("val", 4000)):
        steps = rng.integers(1, 4, count)
        tokens = (np.cumsum(steps) % VOCAB).astype(np.uint16)
        tokens.tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": VOCAB}))


def run(files: dict[str, bytes], config: dict | None) -> dict:
    """One run of the script (``config``: jmp's, with the three lines; None: PyTorch's, unedited)."""
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as tmp:
        work = Path(tmp)
        for name, data in files.items():
            (work / name).write_bytes(data)
        if config is not None:
            (work / "train.py").write_text(with_three_lines(files["train.py"].decode(), config))
        write_data(work)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        compile_flag = "--compile=True" if config is not None else "--compile=False"
        log, code, seconds = launch([sys.executable, "train.py", *ARGS, compile_flag], work, env, 900)
        weights = None
        if (work / "out" / "ckpt.pt").exists():
            import torch

            saved = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
            weights = {k: v.float().numpy() for k, v in saved["model"].items()}
    return {
        "code": code,
        "seconds": seconds,
        "losses": {int(i): float(v) for i, v in _ITER.findall(log)},
        "evals": {int(i): (float(t), float(v)) for i, t, v in _EVAL.findall(log)},
        "compile_notice": "torch.compile(model) of a DistributedModel gives back the model" in log,
        "weights": weights,
        "log_tail": log[-2500:] if code != 0 else "",
    }


def compare(run_: dict, reference: dict) -> dict:
    same = sorted(set(run_["losses"]) & set(reference["losses"]))
    loss_diff = max((abs(run_["losses"][i] - reference["losses"][i]) for i in same), default=None)
    evals = sorted(set(run_["evals"]) & set(reference["evals"]))
    eval_diff = max((abs(a - b) for i in evals for a, b in zip(run_["evals"][i], reference["evals"][i])), default=None)
    weight_diff = None
    if run_["weights"] and reference["weights"]:
        weights, expected = run_["weights"], reference["weights"]
        weight_diff = max(float(np.abs(weights[k] - expected[k]).max()) for k in expected)
    return {
        "iters_compared": len(same),
        "max_loss_diff": loss_diff,
        "evals_compared": len(evals),
        "max_eval_diff": eval_diff,
        "max_checkpoint_weight_diff": weight_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="benchmarks/results/nanogpt_script.json")
    args = parser.parse_args()
    files = read_scripts(args.nanogpt)
    reference = run(files, None)
    if reference["code"] != 0:
        raise SystemExit(f"the PyTorch run failed:\n{reference['log_tail']}")
    result = {"nanogpt_commit": COMMIT, "arguments": ARGS, "reference_seconds": reference["seconds"], "runs": {}}
    for name in args.configs:
        ran = run(files, CONFIGS[name])
        record = {
            "config": CONFIGS[name],
            "ran": ran["code"] == 0,
            "seconds": ran["seconds"],
            "compile_notice": ran["compile_notice"],
            **compare(ran, reference),
            "log_tail": ran["log_tail"],
        }
        result["runs"][name] = record
        print(name, {k: v for k, v in record.items() if k != "log_tail"}, flush=True)
        if ran["log_tail"]:
            print(ran["log_tail"])
    result["machine"] = harness.machine()
    harness.write_results(args.out, result)


if __name__ == "__main__":
    main()
