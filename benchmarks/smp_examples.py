"""AWS's SMP v1 example scripts under ``jmp.launch``, against plain PyTorch.

    python -m benchmarks.smp_examples --examples DIR [--only NAME ...] [--out benchmarks/results/smp_examples.json]

The scripts are not in this repository: DIR is a clone of aws/amazon-sagemaker-examples made outside it
(``git clone https://github.com/aws/amazon-sagemaker-examples DIR``), from which
``benchmarks/aws_scripts/checkout.py`` takes ``training/distributed_training/pytorch/model_parallel/{gpt2,flan-t5}/``
at the commit measured (the last that has them), each file checked against its recorded blob. Without
``--examples`` this says how to get it and stops (exit 0). The scripts' ``data_pipeline.py`` imports h5py:
``pip install -e ".[aws-examples]"``.

Each configuration runs the checkout's ``train.py`` (gpt2/ or flan-t5/) unmodified, as SageMaker would: one
process per device (``python -m jmp.launch -n P --cpu-devices 1``; one configuration drives 8 devices from one
process), SageMaker's ``SM_*`` variables set (the scripts read their defaults from them), tiny models and a few
steps through the scripts' own arguments, on synthetic data in their own input format
(``benchmarks/aws_scripts/make_data.py``). ``benchmarks/aws_scripts/smp_v1_host.py`` wraps the script with what a
CPU host lacks (it says what, on stderr; recorded as ``harness``). Before the runs, every SMP name the scripts read
must be listed in ``tests/runtime/test_smp_module_paths.py``, whose test resolves each (``smp_names_unlisted``).

For each configuration: ran or not, the first error (type, message, the innermost frame and the script's frame),
the logged ``Batch N Loss`` / ``Validation loss`` values, and the same training in plain
PyTorch on CPU (``reference``): the script's own ``parse_args``, model config, ``set_seed`` order, param
groups, optimizer, ``AnnealingLR`` schedule and ``create_pretraining_dataloader`` (imported from the
checkout's files, with a single-process stand-in for ``smp``, so jmp takes no part), one batch per data-parallel rank
per step, the update from their mean loss, ``clip_grad_norm_(grad_clip)``. What SMP logs is rank 0's loss
(``loss_mb.reduce_mean()`` is over that rank's microbatches); the reference records it and the mean over
ranks, and the comparison says which one jmp's value matched.

Tolerances (relative, on every logged loss): fp32 1e-4 (reduction order only). bf16 2e-3 against the fp32
reference, one rounding of bf16 (8 significant bits, 2^-9): as for fp16 below, the logged loss is a float32
cross entropy averaged over 64 tokens, so the forward's roundings mostly cancel; measured 1.2e-4 at tp2 over
3 steps. fp16 2.5e-4, one rounding of fp16 (11 bits, 2^-12): the logged loss is a float32
cross entropy of fp16 logits (Hugging Face upcasts them) averaged over 64 tokens, so the forward's roundings
mostly cancel (torch's own fp16 forward is 4e-6 from fp32 on the first batch), and the fp16 gradients move
Adam's updates little; measured 4.9e-5 over 28 steps with 9 updates, 5x below the tolerance, while one update
more or less (an overflow decided otherwise) moved the loss by 8.7e-4, above it. ``half_forward_gap``
records, per configuration, how far torch's own half-precision forward of the reference's initial weights is
from fp32 on the first batch, which the tolerance must (and does) exceed several times. fp16 runs use SMP's
dynamic loss scaler (initial scale 2^32, ``scale_window`` 1000, ``delayed_shift`` 2, ``min_scale`` 1, as the
script sets); the reference decides each step's overflow as SMP does, from an fp16 copy of its weights
running each data-parallel rank's backward of the scaled loss (``_fp16_backward_overflows``), and updates
its fp32 weights when none overflowed.
T5: the script's ``model_config`` fixes T5's ``dropout_rate`` at 0.1 (no argument turns it off) and jmp's
dropout masks are not torch's, so the configuration sets ``SMP_EXAMPLES_T5_DROPOUT_RATE=0``, which
``smp_v1_host.py`` applies to every ``T5Config`` (said on stderr) and the reference to its own.
``delayed_parameter_initialization``: jmp draws the initial weights on the devices (JAX's generator; SMP draws
them on its GPUs), not with torch's CPU generator, so such a configuration (``"initial_weights": "jmp"``) has its
jmp run save them (``smp_v1_host.py``, ``SMP_EXAMPLES_INITIAL_STATE``) and the reference trains from them, after
checking them against torch's own initialisation of the model (``initial_weights``: constants equal, each drawn
tensor's mean and standard deviation within 5 standard errors of torch's draw).
Data: the test file holds 64 rows, 8 data-parallel ranks x 2 validation batches x the script's default
``--val_batch_size`` 4: each rank's ``DistributedSampler`` share is cut by ``drop_last``, and a rank left with no
batch logs a validation loss of -1.0 (the script's ``eval_model``; the reference does the same).
``--use_distributed_transformer``: the script makes Hugging Face's ``init_weights`` a no-op (on SMP its
``DistributedTransformer`` initialises the weights); jmp keeps the modules' own initialisation, and the
reference makes the same no-op, so both start from the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import types
from pathlib import Path

from benchmarks.aws_scripts import checkout, smp_names, smp_v1_host
from benchmarks.aws_scripts.make_data import make_data as write_data
from benchmarks.script_runs import (
    TIMEOUT_S,
    arg_value,
    first_error,
    jmp_tree,
    launch,
    reference_in_own_process,
    status_line,
    tolerance,
    with_args,
)

ROOT = Path(__file__).resolve().parent.parent
CPU_HOST = ROOT / "benchmarks" / "aws_scripts" / "smp_v1_host.py"
RESULTS = ROOT / "benchmarks" / "results" / "smp_examples.json"

DATA = {"vocab": 256, "seq_len": 32, "train_files": 2, "train_rows": 32, "test_rows": 64, "seed": 1234}
GPT2 = [
    "--model_type", "gpt2", "--num_layers", "2", "--hidden_width", "64", "--num_heads", "4",
    "--max_context_width", "32", "--vocab_size", "256", "--train_batch_size", "2", "--val_batch_size", "2",
    "--max_steps", "3", "--lr", "1e-3", "--warmup", "0", "--resid_pdrop", "0", "--embd_pdrop", "0",
    "--attn_pdrop", "0", "--summary_first_pdrop", "0", "--use_distributed_transformer", "0",
    "--prescaled_batch", "0",
]  # fmt: skip
T5 = [
    "--model_type", "flan_t5", "--num_layers", "2", "--hidden_width", "64", "--num_heads", "4",
    "--intermediate_size", "128", "--max_context_width", "32", "--vocab_size", "256", "--train_batch_size", "2",
    "--val_batch_size", "2", "--max_steps", "3", "--lr", "1e-3", "--warmup", "0", "--use_distributed_transformer",
    "0", "--prescaled_batch", "0", "--flash_attention", "0",
]  # fmt: skip


VALIDATION = {"validation_freq": 2, "validation_batches": 2}
SDP2_DT_BF16 = with_args(
    GPT2, sharded_data_parallel_degree=2, use_distributed_transformer=1, bf16=1, lr_decay_iters=4, checkpoint_freq=2,
    **VALIDATION,
)  # fmt: skip
PP2_FP16 = with_args(GPT2, pipeline_parallel_degree=2, microbatches=2, fp16=1, manual_partition=1, max_steps=28)

# name -> (the checkout's script folder, processes, phases: each a list of the script's arguments). One device per
# process.
CONFIGS: dict[str, dict] = {
    "gpt2_dp2_fp32": {"script": "gpt2", "nproc": 2, "phases": [GPT2]},
    # fp16: SMP's scaler starts at 2^32, and a step is skipped until the fp16 backward stays finite (17 of the
    # first 20 here), so 28 steps make 9 updates. The processes of pipeline stage 1 read no data (the script's
    # DummyDataset); the script checkpoints every layer (its default --activation_checkpointing 1).
    "gpt2_pp2_fp16_manual_partition": {"script": "gpt2", "nproc": 2, "phases": [PP2_FP16]},
    # the same on 4 processes: each data-parallel rank's fp16 backward overflows on its own, as on SMP
    "gpt2_pp2_dp2_fp16_manual_partition": {"script": "gpt2", "nproc": 4, "phases": [PP2_FP16]},
    "gpt2_tp2_bf16": {"script": "gpt2", "nproc": 2, "phases": [with_args(GPT2, tensor_parallel_degree=2, bf16=1)]},
    "gpt2_sdp2": {"script": "gpt2", "nproc": 2, "phases": [with_args(GPT2, sharded_data_parallel_degree=2)]},
    "gpt2_sdp2_distributed_transformer": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, sharded_data_parallel_degree=2, use_distributed_transformer=1)],
    },
    "gpt2_tp2_distributed_transformer_checkpoint_sublayers": {  # each layer's attention and output checkpointed
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, tensor_parallel_degree=2, use_distributed_transformer=1, checkpoint_sublayers=1)],
    },
    "gpt2_dp2_partial_checkpoint_resume": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [
            with_args(GPT2, max_steps=2, lr_decay_iters=4, checkpoint_freq=2),
            with_args(GPT2, max_steps=4, lr_decay_iters=4, checkpoint_freq=2, load_partial=1),
        ],
    },
    "gpt2_dp2_validation": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, validation_freq=2, validation_batches=2, max_steps=4)],
    },
    # issue 55: sharded data parallelism without the distributed transformer reads p.ds_tensor (train.py:1072)
    # of every parameter of its param groups, here after a bf16, delayed-initialisation model_creation
    "gpt2_sdp4_bf16_delayed_param": {
        "script": "gpt2",
        "nproc": 4,
        "phases": [with_args(GPT2, sharded_data_parallel_degree=4, bf16=1, delayed_param=1)],
        "initial_weights": "jmp",
    },
    # issue 55: the script's default --val_batch_size 4 on 8 data-parallel ranks
    "gpt2_dp8_validation_val_batch_size4": {
        "script": "gpt2",
        "nproc": 8,
        "phases": [with_args(GPT2, val_batch_size=4, max_steps=4, **VALIDATION)],
    },
    # issue 55 item 4, the script's argument defaults: --train_batch_size 4, --val_batch_size 4, --prescaled_batch 1
    # (a no-op without tensor parallelism), --activation_checkpointing 1, with validation on
    "gpt2_dp2_batch_size_defaults_validation": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, train_batch_size=4, val_batch_size=4, prescaled_batch=1, max_steps=4, **VALIDATION)],
    },
    # fp16 (SMP's scaler from 2^32: 28 steps make a few updates, as gpt2_pp2_fp16_manual_partition) with validation
    "gpt2_dp2_fp16_validation": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, fp16=1, validation_freq=14, validation_batches=2, max_steps=28)],
    },
    # sharded data parallelism with the distributed transformer in bf16, validation on, saved and resumed
    "gpt2_sdp2_bf16_distributed_transformer_validation_checkpoint_resume": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(SDP2_DT_BF16, max_steps=2), with_args(SDP2_DT_BF16, max_steps=4, load_partial=1)],
    },
    # issue 55 item 4, corpus gaps: tensor parallelism with the script's default --prescaled_batch 1 (each tp group
    # reads one batch), fp16 under sharded data parallelism, and a pipeline with validation on
    "gpt2_tp2_prescaled_batch": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, tensor_parallel_degree=2, prescaled_batch=1, train_batch_size=4)],
    },
    "gpt2_sdp2_fp16": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, sharded_data_parallel_degree=2, fp16=1, max_steps=28)],
    },
    "gpt2_pp2_validation": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, pipeline_parallel_degree=2, microbatches=2, max_steps=4, **VALIDATION)],
    },
    # issue 55 item 3 in one process driving 8 devices (one rank, as a one-process PyTorch run): its batches of 2
    # (training) and 4 (validation) are smaller than the 8 devices, so each device computes all of them
    "gpt2_one_process_8_devices_val_batch_size4": {
        "script": "gpt2",
        "nproc": 1,
        "cpu_devices": 8,
        "phases": [with_args(GPT2, val_batch_size=4, max_steps=4, **VALIDATION)],
    },
    # issue 55 item 4, the script's other model types (--model_type gpt_neox | bloom)
    "gpt_neox_tp2": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, model_type="gpt_neox", tensor_parallel_degree=2)],
    },
    "bloom_sdp2": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [with_args(GPT2, model_type="bloom", sharded_data_parallel_degree=2)],
    },
    # --save_final_full_model, then --load_full: a new run from the saved weights (no optimizer state, step 0)
    "gpt2_dp2_full_model_load_full": {
        "script": "gpt2",
        "nproc": 2,
        "phases": [
            with_args(GPT2, max_steps=2, save_final_full_model=1),
            with_args(GPT2, max_steps=3, load_full=1),
        ],
    },
    # flan-t5's script reads p.ds_tensor too (its train.py:1090) under sharded data parallelism without the
    # distributed transformer; bf16
    "flan_t5_sdp2_bf16": {
        "script": "flan-t5",
        "nproc": 2,
        "phases": [with_args(T5, sharded_data_parallel_degree=2, bf16=1)],
        "env": {"SMP_EXAMPLES_T5_DROPOUT_RATE": "0"},
    },
    "flan_t5_dp2_validation": {
        "script": "flan-t5",
        "nproc": 2,
        "phases": [with_args(T5, max_steps=4, **VALIDATION)],
        "env": {"SMP_EXAMPLES_T5_DROPOUT_RATE": "0"},
    },
    # model_config fixes T5's dropout_rate at 0.1 and no argument turns it off; jmp's dropout masks are not
    # torch's, so the harness sets it to 0 (smp_v1_host.py, said on stderr) here and in the reference
    "flan_t5_tp2_activation_checkpointing": {
        "script": "flan-t5",
        "nproc": 2,
        "phases": [with_args(T5, tensor_parallel_degree=2, activation_checkpointing=1)],
        "env": {"SMP_EXAMPLES_T5_DROPOUT_RATE": "0"},
    },
}

_LOSS = re.compile(r"Batch (\d+) Loss: (\S+?),")
_VAL = re.compile(r"Batch (\d+) Validation loss: (\S+)")
_OTHER_PROCESS = re.compile(r"^(\d{4}-\d\d-\d\d[:T ]|\[transformers\]|smp_v1_host:|[WEIF]\d{4} |jmp\.launch:)")


def _environment(work: Path, data: Path, cfg: dict) -> dict[str, str]:
    env = dict(os.environ) | cfg.get("env", {})
    if cfg.get("initial_weights") == "jmp":
        env["SMP_EXAMPLES_INITIAL_STATE"] = str(initial_state_file(work))
    nproc = cfg["nproc"]
    for name in ("model", "out", "checkpoints"):
        (work / name).mkdir(parents=True, exist_ok=True)
    env |= {
        "SM_NUM_GPUS": str(nproc),
        "SM_OUTPUT_DATA_DIR": str(work / "out"),
        "SM_MODEL_DIR": str(work / "model"),
        "SM_CHANNEL_TRAIN": str(data / "train"),
        "SM_CHANNEL_TEST": str(data / "test"),
        "PYTHONUNBUFFERED": "1",
    }
    return env


def initial_state_file(work: Path) -> Path:
    """Where a configuration with ``"initial_weights": "jmp"`` has its jmp run save the weights it starts from."""
    return work / "initial_state.pt"


def make_data(out: Path) -> Path:
    """The synthetic dataset (``aws_scripts/make_data.py``, fixed seed) under ``out``."""
    write_data(out, **DATA)
    return out


def run_config(name: str, work: Path, data: Path, scripts: Path, timeout_s: int = TIMEOUT_S) -> dict:
    """Run configuration ``name`` through ``jmp.launch``, the scripts from ``scripts`` (the checkout's
    ``model_parallel/`` folder); its record (not the reference)."""
    cfg = CONFIGS[name]
    script = scripts / cfg["script"] / "train.py"
    record: dict = {"name": name, "script": f"{cfg['script']}/train.py", "nproc": cfg["nproc"], "phases": []}
    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    harness: set[str] = set()
    record["ran"] = True
    for phase_args in cfg["phases"]:
        args = [*phase_args, "--checkpoint-dir", str(work / "checkpoints")]
        devices = str(cfg.get("cpu_devices", 1))
        command = [sys.executable, "-m", "jmp.launch", "-n", str(cfg["nproc"]), "--cpu-devices", devices]
        command += [str(CPU_HOST), str(script), *args]
        log, code, seconds = launch(command, work, _environment(work, data, cfg), timeout_s)
        (work / f"phase{len(record['phases'])}.log").write_text(log)
        for step, value in _LOSS.findall(log):
            losses[int(step)] = float(value)
        for step, value in _VAL.findall(log):
            val_losses[int(step)] = float(value)
        harness |= {
            line.split(":", 1)[1].strip() for line in log.splitlines() if line.startswith(smp_v1_host.HARNESS_NOTE)
        }
        finished = code == 0 and "SMP training finished successfully" in log
        record["phases"].append(
            {
                "args": args,
                "returncode": code,
                "seconds": seconds,
                "finished": finished,
                "first_error": first_error(log, scripts, _OTHER_PROCESS) if not finished else None,
            }
        )
        if not finished:
            record["ran"] = False
            if code == "timeout":
                record["phases"][-1]["first_error"] = {"type": "timeout", "message": f"over {timeout_s} s"}
            break
    errors = [p["first_error"] for p in record["phases"] if p["first_error"]]
    record["first_error"] = errors[0] if errors else None
    record["losses"] = {str(k): v for k, v in sorted(losses.items())}
    record["val_losses"] = {str(k): v for k, v in sorted(val_losses.items())}
    record["harness"] = sorted(harness)
    return record


def run_reference(name: str, data: Path, scripts: Path, work: Path | None = None) -> dict:
    """The plain-PyTorch reference of ``name``, in a process of its own (no jmp imported there); ``work`` is the
    jmp run's folder, read for its initial weights when the configuration starts from jmp's."""
    cfg = CONFIGS[name]
    env_for = lambda folder: _environment(folder, data, {k: v for k, v in cfg.items() if k != "initial_weights"})
    arguments = [name, "--data", str(data), "--scripts", str(scripts)]
    if cfg.get("initial_weights") == "jmp":
        if work is None:
            raise ValueError(f"{name} starts from the weights its jmp run saved: give run_reference that run's folder")
        arguments += ["--initial-state", str(initial_state_file(work))]
    return reference_in_own_process("benchmarks.smp_examples", arguments, env_for)


def compare(record: dict, reference: dict) -> dict:
    """jmp's logged losses against the reference's: max relative difference, and to which reading."""
    tol, precision = tolerance(CONFIGS[record["name"]]["phases"][-1])
    result: dict = {"tolerance": tol, "precision": precision}
    if not record["losses"]:
        result["note"] = "no loss was logged"
        return result

    def gap(ours: dict, theirs: list[float]) -> float:
        return max(abs(v - theirs[int(k)]) / abs(theirs[int(k)]) for k, v in ours.items() if int(k) < len(theirs))

    rank0 = gap(record["losses"], reference["losses_rank0"])
    mean = gap(record["losses"], reference["losses_mean"])
    result |= {"max_rel_diff_rank0": rank0, "max_rel_diff_mean_over_ranks": mean}
    result["matches"] = "rank0 (SMP's meaning)" if rank0 <= tol else ("mean over ranks" if mean <= tol else None)
    if record["val_losses"]:
        result["max_rel_diff_validation"] = gap(record["val_losses"], reference["val_losses"])
    result["within_tolerance"] = rank0 <= tol and result.get("max_rel_diff_validation", 0.0) <= tol
    if "initial_weights" in reference:  # jmp drew them (delayed initialisation): torch's distribution?
        check = reference["initial_weights"]
        result["initial_weights"] = check
        result["within_tolerance"] &= check["max_z"] <= 5.0 and not check["constant_tensors_unequal"]
    if reference.get("dropout"):
        result["within_tolerance"] = None
        result["note"] = reference["note"]
    return result


# ---------------------------------------------------------------- the reference (its own process)


def _standin_smp() -> None:
    """A single-process ``smp`` with what the scripts' files call outside training (rank 0 of one)."""
    import torch

    smp = types.ModuleType("smdistributed.modelparallel.torch")
    smp.step = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    for fn in ("rank", "pp_rank", "tp_rank", "dp_rank", "rdp_rank", "local_rank"):
        setattr(smp, fn, lambda: 0)
    smp.broadcast = lambda obj, group: None
    smp.PP_GROUP = "pp"
    smp.nn = types.ModuleType("smdistributed.modelparallel.torch.nn")
    smp.nn.FusedLayerNorm = type("FusedLayerNorm", (torch.nn.LayerNorm,), {})
    root = types.ModuleType("smdistributed")
    root.modelparallel = types.ModuleType("smdistributed.modelparallel")
    root.modelparallel.torch = smp
    root.modelparallel.__version__ = "reference"
    sys.modules |= {
        "smdistributed": root,
        "smdistributed.modelparallel": root.modelparallel,
        "smdistributed.modelparallel.torch": smp,
        "smdistributed.modelparallel.torch.nn": smp.nn,
    }


class _DynamicLossScaler:
    """SMP's (Megatron's) dynamic loss scaler: halve after ``delayed_shift`` overflows, double after a window."""

    def __init__(self, scale=2.0**32, window=1000, min_scale=1.0, delayed_shift=2):
        self.scale, self.window, self.min_scale, self.shift = scale, window, min_scale, delayed_shift
        self.hysteresis, self.iteration, self.last_overflow = delayed_shift, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.scale *= 2
        self.iteration += 1


def _fp16_backward_overflows(fp16_copy, model, batches, microbatches: int, scale: float) -> bool:
    """Whether SMP's fp16 step would overflow: the fp16 model (the fp32 weights cast, as SMP's fp16 copy of its
    fp32 masters) runs each microbatch's backward of its loss times ``scale``, the gradients summed in fp16 as
    SMP sums them, and any that is not finite skips the step. A gradient can overflow inside the backward (an
    activation's) while every weight's gradient times the scale is still in range, so the fp32 gradients
    cannot tell."""
    import torch

    fp16_copy.load_state_dict(model.state_dict())  # cast to fp16
    for ids, mask in batches:  # each data-parallel rank's batch; one rank's overflow skips every rank's step
        fp16_copy.zero_grad(set_to_none=True)
        for piece_ids, piece_mask in zip(ids.chunk(microbatches), mask.chunk(microbatches)):
            loss = fp16_copy(input_ids=piece_ids, attention_mask=piece_mask, labels=piece_ids)["loss"]
            (loss.float() * scale).backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in fp16_copy.parameters() if p.grad is not None):
            return True
    return False


def _initial_weights_check(torch_init: dict, jmp_init: dict) -> dict:
    """jmp's initial weights (delayed initialisation: JAX's generator) against torch's own initialisation of the
    same model: a tensor torch fills with a constant (LayerNorm's ones, the biases' zeros) must be equal; one it
    draws at random must be a sample of the same distribution, its mean and standard deviation within 5 standard
    errors of torch's draw (z: the larger of the two, over the tensors)."""
    unequal, z_max, drawn = [], 0.0, 0
    for name, ours in torch_init.items():
        theirs = jmp_init[name].to(ours.dtype)
        if not ours.is_floating_point() or ours.numel() < 2 or float(ours.std()) == 0.0:
            if not bool((ours == theirs).all()):
                unequal.append(name)
            continue
        n, sigma = ours.numel(), float(ours.std())
        z_std = abs(float(theirs.std()) / sigma - 1) * math.sqrt(n)  # each std: relative error 1/sqrt(2n)
        z_mean = abs(float(theirs.mean() - ours.mean())) / (sigma * math.sqrt(2 / n))
        z_max, drawn = max(z_max, z_std, z_mean), drawn + 1
    return {"drawn_tensors": drawn, "max_z": z_max, "constant_tensors_unequal": unequal}


def reference(name: str, data: Path, scripts: Path, initial_state: Path | None = None) -> dict:
    """The configuration's training in plain PyTorch (fp32, CPU), built with the script's own code (from
    ``scripts``); from the weights in ``initial_state`` (a jmp run's, see ``smp_v1_host.py``) when given."""
    import runpy

    import torch
    import transformers

    from benchmarks.aws_scripts.smp_v1_host import t5_flash_attn_without_flash_attn

    cfg = CONFIGS[name]
    argv = cfg["phases"][-1]
    folder = scripts / cfg["script"]
    _standin_smp()
    t5_flash_attn_without_flash_attn(str(folder))
    sys.path.insert(0, str(folder))
    train = runpy.run_path(str(folder / "train.py"), run_name="smp_reference")
    sys.argv = ["train.py", *argv]
    args = train["parse_args"]()
    if args.use_distributed_transformer > 0:
        # as the script does (train.py:906): the weights are the modules' own initialisation, which jmp keeps
        # (on SMP, its DistributedTransformer would initialise them again)
        transformers.PreTrainedModel.init_weights = lambda self: None
    model_config, args = train["model_config_lib"].get_model_config_from_args(args.model_type, "", args)
    if "SMP_EXAMPLES_T5_DROPOUT_RATE" in os.environ:
        model_config.dropout_rate = float(os.environ["SMP_EXAMPLES_T5_DROPOUT_RATE"])
    transformers.set_seed(args.seed)
    auto = transformers.AutoModelForSeq2SeqLM if args.model_type == "flan_t5" else transformers.AutoModelForCausalLM
    model = auto.from_config(model_config)
    initial_weights = None
    if initial_state is not None:  # the weights jmp drew (delayed initialisation), checked against torch's draw
        jmp_init = torch.load(initial_state)
        initial_weights = _initial_weights_check(model.state_dict(), jmp_init)
        model.load_state_dict(jmp_init)
    if not args.same_seed:
        transformers.set_seed(args.seed)  # seed + tp_rank of rank 0
    pp = max(1, args.pipeline_parallel_degree)
    # the processes that read distinct data: SMP's dp_size, or with prescaled_batch its rdp_size (a tp group reads one)
    ranks = cfg["nproc"] // pp // (max(1, args.tensor_parallel_degree) if args.prescaled_batch else 1)
    paths = sorted(str(p) for p in (data / "train").glob("*.json.gz"))
    load = train["create_pretraining_dataloader"]

    def loaders(files, batch_size, shuffle):
        return [
            load(files, batch_size, args.max_context_width, seed=args.seed, dp_rank=r, dp_size=ranks,
                 shuffle=shuffle, zipped=True, use_last_file_only=args.fast_validation > 0)
            for r in range(ranks)
        ]  # fmt: skip

    def loss_of(ids, mask):
        return model(input_ids=ids, attention_mask=mask, labels=ids)["loss"]

    val_files = sorted(str(p) for p in (data / "test").glob("*.json.gz"))
    result = {"losses_rank0": [], "losses_mean": [], "val_losses": {}, "skipped_steps": [], "half_forward_gap": {}}
    if initial_weights is not None:
        result["initial_weights"] = initial_weights
    first = next(iter(loaders([paths[0]], args.train_batch_size, args.same_seed < 1)[0]))
    with torch.no_grad():
        full = float(loss_of(*first))
        for dtype in (torch.bfloat16, torch.float16):
            copy = auto.from_config(model_config)
            copy.load_state_dict(model.state_dict())
            copy = copy.to(dtype)
            half = float(copy(input_ids=first[0], attention_mask=first[1], labels=first[0])["loss"].float())
            result["half_forward_gap"][str(dtype).removeprefix("torch.")] = abs(half - full) / abs(full)
    fp16_copy = auto.from_config(model_config).to(torch.float16).train() if args.fp16 else None
    params = [p for p in model.parameters() if p.requires_grad]
    # --load_full restarts from the weights the phase before saved (fullmodel.pt): a new optimizer and schedule,
    # step 0 and the first batch again (the script's resume keeps no optimizer state); its losses are the record
    restart = next((i for i, a in enumerate(cfg["phases"]) if arg_value(a, "load_full") == "1"), None)
    phases = cfg["phases"][restart - 1 : restart + 1] if restart else [argv]
    for phase_argv in phases:
        sys.argv = ["train.py", *phase_argv]
        args = train["parse_args"]()
        result |= {"losses_rank0": [], "losses_mean": [], "val_losses": {}, "skipped_steps": []}
        groups = train["get_param_groups_by_weight_decay"](model)
        opt_class = torch.optim.AdamW if args.use_adamw > 0 else torch.optim.Adam
        optimizer = opt_class(groups, betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay)
        scheduler = train["get_learning_rate_scheduler"](optimizer, args)
        scaler = _DynamicLossScaler() if args.fp16 else None
        transformers.set_seed(args.seed)
        model.train()
        steps = 0
        for index in range(args.epochs * len(paths)):
            if steps >= args.max_steps:
                break
            for batches in zip(*loaders([paths[index % len(paths)]], args.train_batch_size, args.same_seed < 1)):
                if steps >= args.max_steps:
                    break
                optimizer.zero_grad(set_to_none=True)
                per_rank = [loss_of(ids, mask) for ids, mask in batches]
                loss = torch.stack(per_rank).mean()
                loss.backward()
                overflow = False
                if scaler is not None:  # SMP skips a step whose fp16 backward of the scaled loss overflowed
                    overflow = _fp16_backward_overflows(fp16_copy, model, batches, args.microbatches, scaler.scale)
                    scaler.update(overflow)
                if overflow:
                    result["skipped_steps"].append(steps)
                else:
                    # as the script clips: clip_master_grads only when sharded_data_parallel_degree < 1 (never, with
                    # its default of 1), sdp_gradient_clipping when it is above 1
                    if args.sharded_data_parallel_degree != 1:
                        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
                    optimizer.step()
                    scheduler.step()
                result["losses_rank0"].append(float(per_rank[0]))
                result["losses_mean"].append(float(loss))
                steps += 1
                if args.validation_freq and steps % args.validation_freq == 0:
                    model.eval()
                    with torch.no_grad():
                        total = 0.0
                        for val in loaders(val_files, args.val_batch_size, True):
                            batches_seen = [float(loss_of(*b)) for i, b in zip(range(args.validation_batches), val)]
                            total += sum(batches_seen) / len(batches_seen) if batches_seen else math.nan
                    # the script's eval_model logs -1.0 when its rank's loader has no batch (drop_last)
                    result["val_losses"][steps - 1] = total / ranks if not math.isnan(total) else -1.0
                    model.train()
    result["val_losses"] = [result["val_losses"].get(k, math.nan) for k in range(steps)]
    if getattr(model_config, "dropout_rate", 0.0) > 0:
        result["dropout"] = True
        result["note"] = f"T5's dropout_rate is {model_config.dropout_rate}: losses recorded, not compared"
    return result


H5PY = 'The scripts\' data_pipeline.py imports h5py: pip install -e ".[aws-examples]"'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=Path, default=None, help="a clone of aws/amazon-sagemaker-examples")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scripts", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial-state", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.reference:
        print(json.dumps(reference(options.reference, options.data, options.scripts, options.initial_state)))
        return
    if options.examples is None:
        print(checkout.how_to_get("benchmarks.smp_examples", checkout.SMP_V1, H5PY) + "\nSkipped: no --examples DIR.")
        return
    if importlib.util.find_spec("h5py") is None:
        parser.error(H5PY)
    names = options.only or list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"no configuration {unknown}; there are {list(CONFIGS)}")
    results = json.loads(options.out.read_text()) if options.out.exists() and options.only else {}
    results.setdefault("configurations", {})
    with tempfile.TemporaryDirectory(prefix="smp-examples-") as tmp:
        try:
            scripts = checkout.materialise(options.examples, checkout.SMP_V1, Path(tmp) / "examples")
        except checkout.CheckoutError as e:
            parser.error(str(e))
        results["smp_names_unlisted"] = smp_names.unlisted(sorted(scripts.rglob("*.py")), scripts)
        print(smp_names.status_line(results["smp_names_unlisted"]), flush=True)
        data = make_data(Path(tmp) / "data")
        for name in names:  # one at a time: each runs its processes on every core
            work = Path(tmp) / name
            work.mkdir()
            record = run_config(name, work, data, scripts)
            record["reference"] = run_reference(name, data, scripts, work)
            record["comparison"] = compare(record, record["reference"])
            results["configurations"][name] = record
            print(status_line(name, record), flush=True)
    results["data"] = DATA
    results["jmp_tree"] = jmp_tree()
    results["scripts"] = {"origin": checkout.ORIGIN, "commit": checkout.SMP_V1.commit, "folder": checkout.SMP_V1.folder}
    results["command"] = (
        "python -m jmp.launch -n P --cpu-devices 1 benchmarks/aws_scripts/smp_v1_host.py "
        "DIR/training/distributed_training/pytorch/model_parallel/{gpt2,flan-t5}/train.py ..."
    )
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
