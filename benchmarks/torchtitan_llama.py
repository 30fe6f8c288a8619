"""torchtitan's own Llama, parallelised by torchtitan's own ``parallelize_llama`` at tp2 x fsdp4 under
``python -m jmp.launch``, against the same model unparallelised in PyTorch over 3 AdamW steps.

    python -m benchmarks.torchtitan_llama [--out benchmarks/results/torchtitan_llama.json]

torchtitan is not a dependency: install its PyPI release 0.2.2 without letting pip touch torch, with the few
packages its ``torchtitan.models.llama3`` import chain needs (``INSTALL``; or ``--target DIR`` and
``PYTHONPATH=DIR``). Without torchtitan this says so and stops (exit 0). 0.2.2 is the last release whose Llama
is split by ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
``PrepareModuleInput`` and ``loss_parallel``. In 0.3.0 each module places its own DTensors
(``torchtitan.protocols.module.Module.parallelize``), which no PyTorch plan call reaches; with 0.3 installed the
run records where its ``debugmodel`` stops under each ``spmd_backend`` (``torchtitan_llama_0.3.0.json``):
``spmd_types`` (the default) in ``parallelize_llama`` at ``spmd_types.set_current_mesh(mesh)``, which takes
torch's own ``DeviceMesh`` class or a sequence of process groups (jmp's mesh is neither); ``partial_dtensor``
after it, at ``init_weights()``, whose ``normal_`` on a DTensor needs torch's own ``DeviceMesh`` for DTensor's
sharding propagation; ``full_dtensor`` at ``fully_shard(..., dp_mesh_dims=...)``, an SPMD-typed mesh jmp refuses.

One process drives 8 emulated CPU devices (``jmp.launch -n 1 --cpu-devices 8``), then two drive 4 each (both
feed the same rows, so the job's batch is those rows twice and its mean loss theirs). There torchtitan's
``init_device_mesh``, ``parallelize_module`` and ``fully_shard`` (bound at its import from torch's modules) are
jmp's. The run follows torchtitan's trainer: ``Transformer`` (dim 64, 2 layers, 4 heads, 2 key/value heads,
vocab 256) built on the meta device; ``ParallelDims(dp_shard=4, tp=2, world_size=8)``, whose ``build_mesh``
unflattens and flattens the world mesh; ``parallelize_llama(model, parallel_dims, job_config)`` (``apply_tp``,
then ``apply_fsdp``: ``fully_shard`` on the embedding, each block, ``[norm, output]`` and the model) with
torchtitan's ``JobConfig`` at fp32 parameters and no activation checkpointing; ``to_empty`` and
``init_weights()`` under ``no_grad``. The reference is a host ``Transformer`` given those values. Each step is
torchtitan's: ``get_train_context(loss_parallel=True)`` around the forward, its ``cross_entropy_loss`` (a sum)
over the batch's tokens, backward, an ``AdamW`` step. Compared: each step's loss and every parameter after 3
steps, within 1e-4. A call that stops the run is recorded instead (its stage and the error's last frames).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "torchtitan_llama.json"
VERSION = "0.2.2"
MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32)
STEPS, ROWS, LENGTH, LR, TOLERANCE = 3, 8, 16, 1e-3, 1e-4
INSTALL = (
    "pip install --no-deps torchtitan==0.2.2 tyro docstring_parser torchdata tensorboard datasets multiprocess pandas "
    "pyarrow dill xxhash triton"
)
LAUNCHES = ((1, 8), (2, 4))  # processes, CPU devices each: 8 devices, tp2 x fsdp4


def launched(out: str) -> None:
    """The run inside ``jmp.launch``: torchtitan's code, then the reference; the record goes to ``out``."""
    import torch

    record: dict = {"stage": "import torchtitan"}
    try:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.config import JobConfig
        from torchtitan.distributed import ParallelDims, parallel_dims
        from torchtitan.distributed.utils import get_train_context
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
        from torchtitan.models.llama3.infra import parallelize as titan_parallelize

        record["resolved"] = {  # the names torchtitan's modules bound at import: jmp's under the launcher
            "init_device_mesh": parallel_dims.init_device_mesh.__module__,
            **{name: getattr(titan_parallelize, name).__module__ for name in ("parallelize_module", "fully_shard")},
        }
        record["stage"] = "Transformer(...) on the meta device"
        with torch.device("meta"):
            model = Transformer(TransformerModelArgs(**MODEL))
        job = JobConfig()
        job.training.mixed_precision_param = "float32"
        job.training.seq_len = LENGTH
        job.activation_checkpoint.mode = "none"
        job.parallelism.tensor_parallel_degree, job.parallelism.data_parallel_shard_degree = 2, 4
        record["stage"] = "ParallelDims(dp_shard=4, tp=2).build_mesh()"
        dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)
        dims.build_mesh()
        record["stage"] = "parallelize_llama(model, parallel_dims, job_config)"
        parallelize_llama(model, dims, job)
        record["class"] = type(model).__name__
        record["stage"] = "to_empty(), then init_weights() under no_grad (torchtitan's trainer)"
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
        model.train()
        reference = Transformer(TransformerModelArgs(**MODEL))
        reference.load_state_dict(model.state_dict())  # the values init_weights gave, before the model's first call
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, MODEL["vocab_size"], (ROWS, LENGTH + 1), generator=generator) for _ in range(STEPS)]

        def train(net: torch.nn.Module, where: str) -> list[float]:
            optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
            losses = []
            for step, batch in enumerate(data):
                record["stage"] = f"{where}: step {step}"
                inputs, labels = batch[:, :-1], batch[:, 1:]
                with get_train_context(True)():
                    loss = cross_entropy_loss(net(inputs), labels) / labels.numel()
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            return losses

        losses = train(model, "torchtitan's model under jmp")
        expected = train(reference, "the reference in PyTorch")
        record["stage"] = "compare"
        trained, wanted = model.state_dict(), reference.state_dict()
        differences = {name: float((trained[name] - value).abs().max()) for name, value in wanted.items()}
        loss_gap = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        from jmp.fsdp.fully_sharded import model_of

        built = model_of(model)
        record.update(
            losses=losses,
            pytorch_losses=expected,
            max_loss_difference=loss_gap,
            max_parameter_difference=max(differences.values()),
            worst_parameter=max(differences, key=differences.get),
            mesh=dict(built.layout.mesh.shape),
            specs={n: [str(a) for a in built.layout.specs[n]] for n in _SHOWN},
            within_tolerance=loss_gap <= TOLERANCE and max(differences.values()) <= TOLERANCE,
            stage="done",
        )
    except Exception as error:  # the call that stops it, recorded
        frames = traceback.extract_tb(error.__traceback__)
        record["stopped"] = {
            "error": f"{type(error).__name__}: {error}"[:2000],
            "frames": [f"{_short(f.filename)}:{f.lineno} {f.name}: {f.line}" for f in frames[-8:]],
        }
    if jax_process_index() == 0:
        Path(out).write_text(json.dumps(record, indent=1))


def launched_newer(out: str) -> None:
    """torchtitan 0.3's Llama (its ``debugmodel`` config at tp 2 x fsdp 4, sequence 16) through its trainer's calls
    under each of its ``spmd_backend``s, up to a forward: the call that stops each is recorded."""
    import torch
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    record: dict = {}
    for backend in ("spmd_types", "partial_dtensor", "full_dtensor"):
        stage = "config"
        try:
            config = llama3_debugmodel()
            config.parallelism.tensor_parallel_degree, config.parallelism.data_parallel_shard_degree = 2, 4
            config.parallelism.spmd_backend, config.training.seq_len, config.activation_checkpoint = backend, 16, None
            spec = config.model_spec
            spec.model.update_from_config(config=config)
            with torch.device("meta"):
                model = spec.model.build()
            stage = "ParallelDims.from_config(...).build_mesh()"
            dims = ParallelDims.from_config(config.parallelism, 8)
            dims.build_mesh()
            stage = "parallelize_llama(model, parallel_dims=..., ...)"
            parallel = dict(training=config.training, parallelism=config.parallelism, compile_config=config.compile)
            folder = tempfile.gettempdir()
            spec.parallelize_fn(model, parallel_dims=dims, ac_config=None, dump_folder=folder, **parallel)
            stage = "to_empty(), then init_weights() under no_grad"
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights()
            stage = "forward"
            model(torch.randint(0, 2048, (8, 16)))
            record[backend] = {"stage": "done"}
        except Exception as error:
            frames = traceback.extract_tb(error.__traceback__)
            record[backend] = {
                "stage": stage,
                "error": f"{type(error).__name__}: {error}"[:600],
                "frames": [f"{_short(f.filename)}:{f.lineno} {f.name}: {f.line}" for f in frames[-9:]],
            }
    if jax_process_index() == 0:
        Path(out).write_text(json.dumps(record, indent=1))


def _short(filename: str) -> str:
    """A frame's file from its package's folder on (no install paths)."""
    return re.sub(r"^.*?/(?=(torchtitan|spmd_types|torch|jmp|benchmarks)/)", "", filename)


def jax_process_index() -> int:
    import jax

    return jax.process_index()


_SHOWN = (
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.wo.weight",
    "layers.0.feed_forward.w2.weight",
    "norm.weight",
    "output.weight",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--launched", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launched:
        from importlib.metadata import version

        (launched if version("torchtitan") == VERSION else launched_newer)(args.launched)
        return
    if importlib.util.find_spec("torchtitan") is None:
        print(f"torchtitan is not installed; nothing run. To run this: {INSTALL}")
        return
    from importlib.metadata import version

    from benchmarks.script_runs import jmp_tree

    launches = LAUNCHES if version("torchtitan") == VERSION else LAUNCHES[:1]
    runs = {f"{n} process(es) x {k} devices": _run(n, k) for n, k in launches}
    record = {"torchtitan": version("torchtitan"), "runs": runs, **jmp_tree()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


def _run(processes: int, devices: int) -> dict:
    """One launch; process 0's record."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "record.json"
        command = [sys.executable, "-m", "jmp.launch", "-n", str(processes), "--cpu-devices", str(devices)]
        command += ["-m", "benchmarks.torchtitan_llama", "--launched", str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        record = json.loads(out.read_text()) if out.exists() else {"stopped": {"error": run.stderr[-3000:]}}
    return {"launch": " ".join(command[2:7]), **record}


if __name__ == "__main__":
    main()
