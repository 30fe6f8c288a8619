"""AWS's SMP v2 training script (``shared-scripts/train.py``) under ``jmp.launch``, against plain PyTorch.

    python -m benchmarks.smp_v2_examples --examples DIR [--only NAME ...] [--out benchmarks/results/...json]

The script is not in this repository: DIR is a clone of aws/amazon-sagemaker-examples made outside it
(``git clone https://github.com/aws/amazon-sagemaker-examples DIR``), from which
``benchmarks/aws_scripts/checkout.py`` takes ``      build_and_train_models/sm-distributed_model_parallel_v2/
shared-scripts/`` (the folder's name starts with six spaces) at the commit measured, each file checked against its
recorded blob. Without ``--examples`` this says how to get it and stops (exit 0).

Each configuration runs the checkout's ``train.py`` unmodified, as SageMaker runs it: one process per device
(``python -m jmp.launch -n P --cpu-devices 1``), the SMP parameters as ``SM_HP_MP_PARAMETERS``
(``--mp-parameters``), the notebooks' flags (docs/smp_v2_census.md, section 6) with a tiny Llama 2
(``--hidden_width 64 --num_layers 2 --num_heads 4 --max_context_width 32 --vocab_size 128``) and a few steps,
``--fp8 0``, on synthetic data in the script's ``gpt_jsonl`` format (``benchmarks/aws_scripts/make_data.py``).
``benchmarks/aws_scripts/smp_v2_host.py`` wraps the script with what a CPU host lacks (it says what, on stderr;
recorded as ``harness``). Before the runs, every SMP name the scripts read must be listed in
``tests/runtime/test_smp_module_paths.py``, whose test resolves each (``smp_names_unlisted``).

Process counts. The notebooks run 8 GPUs (hybrid shard 4 x replicate 2 at tp 1, tp 2 x hybrid shard 4). On two
cores, 8 processes each compiling their own program take minutes per configuration, so the layouts run on 4
(hybrid shard 2 x replicate 2; tp 2 x hybrid shard 2): the same three kinds of group (shard, replica, tp peers)
with every degree above 1. The 8-process forms are configurations too (``..._8proc``), run when named.

For each configuration: ran or not, the first error (type, message, the innermost frame and the script's
frame), the logged ``Batch N Loss`` values (rank 0's ``loss.item()``: its own rows' loss, as on SMP) and
``Validation loss`` values (every 2 steps, as the notebooks validate at each save: ``eval_model``'s all-reduced
mean; after a resume the script's validation loader skips the batches the saved job had read, and so does the
reference's), and the same training in plain PyTorch in one process (``reference``): the script's own
``get_model_config`` / ``create_model``, ``get_param_groups_by_weight_decay``, AdamW, ``AnnealingLR`` and
``create_data_pipeline``
(one pipeline per data-parallel rank, ``dp_rank = rank // tp``), each step the mean of the data-parallel ranks'
losses backpropagated (FSDP's gradient average), ``clip_grad_norm_(grad_clip)``, ``optimizer.step()``,
``lr_scheduler.step()``.

Initial weights. ``--delayed_param 1`` (every notebook) builds the model on the meta device and jmp initialises
it directly in its shards from JAX's generator (the script's ``DelayedParamIniter`` code, JAX's random numbers;
tests/fsdp check its distributions), so no torch process draws the same values. Each configuration therefore
first runs the same launch with ``--max_steps 0 --save_final_model 1``: the script's own full-state-dict save
(``FULL_STATE_DICT``, rank 0's ``pytorch_model.bin``) writes the initial weights, seeded by the config's
``random_seed`` as in the training run, and the reference starts from them. The comparison is of training, not
of initialisation: a different start would show as a gap at step 0.

Tolerances (relative, per logged loss, rank 0's). fp32: 1e-4 (reduction order only). bf16 (``--bf16 1``: FSDP's
``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)``, float32 masters): 2e-3, one rounding of bf16 (8
significant bits, unit roundoff 2^-9 = 1.95e-3) on the loss: the logged loss is a float32 cross entropy of bf16
logits averaged over 64 tokens, so the forward's roundings mostly cancel. Beside the fp32 reference the
reference records PyTorch's own bf16 training of the same steps (parameters cast to bf16 for forward and
backward, gradients applied to float32 masters: what FSDP's ``MixedPrecision`` computes) and its gap to fp32
(``torch_bf16_gap``), which the tolerance must exceed: jmp's bf16 is then as far from fp32 as torch's own bf16.
Measured over 4 steps: torch's bf16 is 0.9e-4 to 1.9e-4 from fp32; jmp's 2.7e-5 to 2.5e-4, the same order (and
1.5e-4 to 2e-4 from torch's bf16: the two round differently; XLA:CPU computes many bf16 ops in float32). What the
tolerance must catch is ten times above it: one update more or less moves the loss by 1-4% from step to step.
fp8 (``--fp8 1 --bf16 1``, with activation checkpointing: TE's ``fp8_autocast`` with ``DelayedScaling``, which
``smp_v2_host.py`` gives as jmp's fp8):
2e-2 against the fp32 reference. E4M3 keeps 3 mantissa bits (unit roundoff 2^-4) on every Linear's inputs and
weights, E5M2 2 bits on its output gradients, with per-tensor scales; the logged loss averages the roundings over
every dot's contraction and 64 tokens. jmp's own fp8 runs 0.8% at most from fp32 over 200 steps
(``benchmarks/fp8.py``); here 1.9e-3 over 4 steps.

Sharded checkpoints: the script's ``torch.distributed.checkpoint.save_state_dict`` / ``load_state_dict`` (torch's
DCP over gloo) on jmp's full-tensor SHARDED_STATE_DICT, and ``load_sharded_optimizer_state_dict`` with SMP's
``process_group=`` (``jmp.fsdp.distributed_checkpoint``). The script passes ``coordinator_rank=min(global ranks of
the shard group)``, a global rank as the PyTorch of SMP's containers used it; torch's DCP (since 2.6) reads it as a
rank within the group, so with more than one replica every replica but the first named a rank its group does not
have (``ValueError: Group rank 2 is not part of group``, checkpoints.py:557). Under ``jmp.launch`` the script's
``save_state_dict`` / ``load_state_dict`` are jmp's, which take a member's global rank as that member: hybrid
shard 2 x replicate 2 resumes and continues to the digit (steps 2-3 log the uninterrupted run's losses).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import types
from pathlib import Path

from benchmarks.aws_scripts import checkout, smp_names, smp_v2_host
from benchmarks.aws_scripts.make_data import make_data as write_data
from benchmarks.script_runs import (
    TIMEOUT_S,
    arg_value,
    first_error,
    jmp_tree,
    launch,
    reference_in_own_process,
    short_path,
    status_line,
    tolerance,
    with_args,
)

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ROOT / "benchmarks" / "aws_scripts"
CPU_HOST = HOSTS / "smp_v2_host.py"
RESULTS = ROOT / "benchmarks" / "results" / "smp_v2_examples.json"

DATA = {"vocab": 128, "seq_len": 32, "train_files": 2, "train_rows": 32, "test_rows": 32, "seed": 1234}
# the notebooks' common flags (census section 6), the model and the schedule scaled to a few CPU steps
LLAMA = [
    "--model_type", "llama_v2", "--hidden_width", "64", "--num_layers", "2", "--num_heads", "4",
    "--llama_intermediate_size", "128", "--max_context_width", "32", "--vocab_size", "128",
    "--train_batch_size", "2", "--max_steps", "4", "--fp8", "0", "--bf16", "0", "--delayed_param", "1",
    "--activation_checkpointing", "1", "--use_smp_implementation", "1", "--sharding_strategy", "hybrid_shard",
    "--auto_wrap_policy", "transformer_auto_wrap_policy", "--backward_fetch_policy", "backward_pre",
    "--forward_prefetch", "1", "--limit_all_gathers", "1", "--lr", "1e-3", "--min_lr", "1e-4",
    "--lr_decay_style", "cosine", "--lr_decay_iters", "8", "--warmup", "0", "--weight_decay", "0.2",
    "--beta1", "0.9", "--beta2", "0.95", "--seed", "12345", "--fast_validation", "0",
    "--num_kept_checkpoints", "2", "--checkpoint_freq", "1000", "--validation_freq", "2",
    "--validation_batches", "2", "--val_batch_size", "2",
]  # fmt: skip
HS2 = {"hybrid_shard_degree": 2}
TP2_HS2 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
OFFLOAD = {"sm_activation_offloading": True, "activation_loading_horizon": 2}
RESUME_FROM = "{checkpoints}/llama_v2-2steps"  # the script's subdir f"{model_type}-{total_steps}steps" (Llama only)


def _save_then_resume(base: list[str]) -> list[list[str]]:
    return [
        with_args(base, max_steps=2, checkpoint_freq=2),
        with_args(base, max_steps=4, checkpoint_freq=2, resume_from_checkpoint=RESUME_FROM),
    ]


# name -> processes, SMP parameters, phases (each a list of the script's arguments). One device per process.
CONFIGS: dict[str, dict] = {
    # FULL_SHARD-like over 2 processes
    "llama_hs2_fp32": {"nproc": 2, "mp": HS2, "phases": [LLAMA]},
    "llama_hs2_rep2_fp32": {"nproc": 4, "mp": HS2, "phases": [LLAMA]},
    "llama_hs2_rep2_bf16": {"nproc": 4, "mp": HS2, "phases": [with_args(LLAMA, bf16=1)]},
    "llama_tp2_hs2_fp32": {"nproc": 4, "mp": TP2_HS2, "phases": [LLAMA]},
    "llama_tp2_hs2_bf16": {"nproc": 4, "mp": TP2_HS2, "phases": [with_args(LLAMA, bf16=1)]},
    # the GPT-NeoX training notebook's SMP parameters: offloading on, horizon 2
    "llama_tp2_hs2_bf16_offload": {"nproc": 4, "mp": TP2_HS2 | OFFLOAD, "phases": [with_args(LLAMA, bf16=1)]},
    "llama_hs2_rep2_save_resume": {"nproc": 4, "mp": HS2, "phases": _save_then_resume(LLAMA)},
    "llama_tp2_hs2_save_resume": {"nproc": 4, "mp": TP2_HS2, "phases": _save_then_resume(LLAMA)},
    # the GPT-NeoX notebooks' model type (tsm.transform says what jmp's tp rules split of it)
    "gpt_neox_tp2_hs2_bf16": {"nproc": 4, "mp": TP2_HS2, "phases": [with_args(LLAMA, model_type="gpt_neox", bf16=1)]},
    # --fp8 1 (every notebook on H100s): TE's fp8_autocast and DelayedScaling recipe are jmp's fp8 (smp_v2_host.py);
    # with the notebooks' activation checkpointing, whose TE checkpoint_fn takes tsm.state.get_rng_state_tracker
    "llama_hs2_fp8_bf16": {"nproc": 2, "mp": HS2, "phases": [with_args(LLAMA, fp8=1, bf16=1)]},
    # the notebooks' 8-GPU layouts, run when named (--only)
    "llama_hs4_rep2_fp32_8proc": {"nproc": 8, "mp": {"hybrid_shard_degree": 4}, "phases": [LLAMA]},
    "llama_tp2_hs4_bf16_offload_8proc": {
        "nproc": 8,
        "mp": {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4} | OFFLOAD,
        "phases": [with_args(LLAMA, bf16=1)],
    },
    # the GPT-NeoX training notebook's job on a tiny Llama: its SMP parameters, a save, then the resume job
    "llama_tp2_hs4_bf16_offload_save_resume_8proc": {
        "nproc": 8,
        "mp": {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4} | OFFLOAD,
        "phases": _save_then_resume(with_args(LLAMA, bf16=1)),
    },
}
DEFAULT_RUN = [name for name in CONFIGS if not name.endswith("_8proc")]

_LOSS = re.compile(r"Batch (\d+) Loss: (\S+?),")
_VAL = re.compile(r"Batch (\d+) Validation loss: (\S+)")
_FINISHED = "FSDP training finished successfully"
_INTERLEAVED = re.compile(
    r"^(\d{4}-\d\d-\d\d[:T ]|\[\d{4}-|\[transformers\]|smp_v2_host:|[WEIF]\d{4} |jmp\.launch:|/|Traceback \(most)"
)


def _environment(work: Path, data: Path, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env |= {
        "SM_NUM_GPUS": str(nproc),
        "SM_CHANNEL_TRAIN": str(data / "train"),
        "SM_CHANNEL_TEST": str(data / "test"),
        "PYTHONUNBUFFERED": "1",
    }
    return env


def make_data(out: Path) -> Path:
    """The synthetic dataset (fixed seed) under ``out``: ``aws_scripts/make_data.py``, as the v2 script's
    ``gpt_jsonl`` format is the v1 scripts' pretraining data's (gzip'd JSON lines of ``input_ids`` and
    ``attention_mask``)."""
    write_data(out, **DATA)
    return out


def command(cfg: dict, args: list[str], scripts: Path) -> list[str]:
    """The launch: ``jmp.launch`` running ``smp_v2_host.py`` around ``scripts``' ``train.py`` with ``args``."""
    launch = [sys.executable, "-m", "jmp.launch", "-n", str(cfg["nproc"]), "--cpu-devices", "1"]
    return [*launch, "--mp-parameters", json.dumps(cfg["mp"]), str(CPU_HOST), str(scripts / "train.py"), *args]


def run_config(name: str, work: Path, data: Path, scripts: Path, timeout_s: int = TIMEOUT_S) -> dict:
    """Run configuration ``name`` through ``jmp.launch``: first its initial weights (``--max_steps 0
    --save_final_model 1`` into ``work/init``), then its phases; its record (not the reference)."""
    cfg = CONFIGS[name]
    checkpoints = work / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    record: dict = {"name": name, "nproc": cfg["nproc"], "mp_parameters": cfg["mp"], "phases": []}
    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    harness: set[str] = set()
    record["ran"] = True
    init = with_args(cfg["phases"][0], max_steps=0, save_final_model=1, model_dir=work / "init")
    phases = [("init", init), *(("train", p) for p in cfg["phases"])]
    for kind, phase_args in phases:
        args = [a.format(checkpoints=checkpoints) for a in phase_args] + ["--checkpoint_dir", str(checkpoints)]
        launched = command(cfg, args, scripts)
        log, code, seconds = launch(launched, work, _environment(work, data, cfg["nproc"]), timeout_s)
        (work / f"phase{len(record['phases'])}.log").write_text(log)
        if kind == "train":
            for step, value in _LOSS.findall(log):
                losses[int(step)] = float(value)
            for step, value in _VAL.findall(log):
                val_losses[int(step)] = float(value)
        harness |= {
            line.split(":", 1)[1].strip() for line in log.splitlines() if line.startswith(smp_v2_host.HARNESS_NOTE)
        }
        finished = code == 0 and _FINISHED in log
        record["phases"].append(
            {
                "kind": kind,
                "command": [short_path(a, scripts) for a in launched[2:]],
                "returncode": code,
                "seconds": seconds,
                "finished": finished,
                "first_error": first_error(log, scripts, _INTERLEAVED) if not finished else None,
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
    record["initial_weights"] = str(work / "init" / "pytorch_model.bin")
    return record


def run_reference(name: str, data: Path, scripts: Path, initial_weights: Path) -> dict:
    """The plain-PyTorch reference of ``name``, in a process of its own (no jmp imported there)."""
    arguments = [name, "--data", str(data), "--scripts", str(scripts), "--initial-weights", str(initial_weights)]
    env_for = lambda folder: _environment(folder, data, CONFIGS[name]["nproc"])
    return reference_in_own_process("benchmarks.smp_v2_examples", arguments, env_for)


def compare(record: dict, reference: dict) -> dict:
    """jmp's logged losses (rank 0's) against the reference's rank-0 losses: max relative difference."""
    tol, precision = tolerance(CONFIGS[record["name"]]["phases"][-1])
    result: dict = {"tolerance": tol, "precision": precision}
    if not record["losses"]:
        result["note"] = "no loss was logged"
        result["within_tolerance"] = False
        return result

    def gap(ours: dict, theirs: list[float]) -> float:
        return max(abs(v - theirs[int(k)]) / abs(theirs[int(k)]) for k, v in ours.items() if int(k) < len(theirs))

    result["max_rel_diff"] = gap(record["losses"], reference["losses_rank0"])
    result["per_step_rel_diff"] = {
        k: abs(v - reference["losses_rank0"][int(k)]) / abs(reference["losses_rank0"][int(k)])
        for k, v in record["losses"].items()
        if int(k) < len(reference["losses_rank0"])
    }
    if record["val_losses"]:
        theirs = reference["val_losses"]
        result["max_rel_diff_validation"] = max(
            abs(v - theirs[k]) / abs(theirs[k]) for k, v in record["val_losses"].items()
        )
    if precision == "bf16":
        result["torch_bf16_gap"] = gap(
            {str(i): v for i, v in enumerate(reference["losses_rank0_torch_bf16"])}, reference["losses_rank0"]
        )
        result["max_rel_diff_to_torch_bf16"] = gap(record["losses"], reference["losses_rank0_torch_bf16"])
    result["within_tolerance"] = result["max_rel_diff"] <= tol and result.get("max_rel_diff_validation", 0.0) <= tol
    return result


# ---------------------------------------------------------------- the reference (its own process)


def _standin_tsm() -> None:
    """``torch.sagemaker.logger`` (``fsdp_utils.py`` imports it at the top): a logger, so the script's model and
    schedule code imports in a process without jmp."""
    import torch

    tsm = types.ModuleType("torch.sagemaker")
    tsm.__path__ = []
    logger = types.ModuleType("torch.sagemaker.logger")
    logger.get_logger = lambda: logging.getLogger("smp_v2_reference")
    tsm.logger = logger
    torch.sagemaker = tsm
    sys.modules |= {"torch.sagemaker": tsm, "torch.sagemaker.logger": logger}


def reference(name: str, data: Path, scripts: Path, initial_weights: Path) -> dict:
    """The configuration's training in plain PyTorch (CPU, one process), built with the script's code (from
    ``scripts``)."""
    import copy

    import torch
    import torch.distributed as dist

    cfg = CONFIGS[name]
    argv = [a for a in cfg["phases"][-1] if "{checkpoints}" not in a]
    resumed_at = None
    if "--resume_from_checkpoint" in argv:  # the reference trains straight through, from the same data
        i = argv.index("--resume_from_checkpoint")
        del argv[i : i + 2]
        resumed_at = int(arg_value(cfg["phases"][0], "max_steps"))
    sys.path[:0] = [str(scripts)]
    sys.meta_path.append(smp_v2_host.StandInFinder())  # datasets (data/pipelines imports it)
    smp_v2_host.sdpa_for_flash_attention_2()
    _standin_tsm()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # AnnealingLR and the pipeline ask
    from arguments import parse_args
    from data.pipelines import GPTDataPipeline, create_data_pipeline
    from train_utils import (
        create_model,
        get_learning_rate_scheduler,
        get_model_config,
        get_param_groups_by_weight_decay,
    )
    from transformers import set_seed

    sys.argv = ["train.py", *argv, "--training_dir", str(data / "train"), "--test_dir", str(data / "test")]
    args, _ = parse_args()
    tp = int(cfg["mp"].get("tensor_parallel_degree", 1))
    ranks = cfg["nproc"] // tp  # dp_size = world // (tp * cp); tp peers read the same rows
    set_seed(args.seed)
    model_config = get_model_config(args)
    model = create_model(args, model_config=model_config, dtype=torch.float32)
    model.load_state_dict(torch.load(initial_weights, weights_only=True))
    start = copy.deepcopy(model.state_dict())

    def train(bf16: bool) -> tuple[list[float], dict[str, float]]:
        model.load_state_dict(start)
        half = copy.deepcopy(model).to(torch.bfloat16) if bf16 else None
        if half is not None:  # MixedPrecision(buffer_dtype=float32), as the script sets with the SMP implementation
            for (_, mixed), (_, full) in zip(half.named_modules(), model.named_modules()):
                mixed._buffers.update({k: b.clone() for k, b in full._buffers.items() if b is not None})
        groups = get_param_groups_by_weight_decay(model)
        betas = (args.beta1, args.beta2)
        optimizer = torch.optim.AdamW(groups, betas=betas, lr=args.lr, weight_decay=args.weight_decay)
        scheduler = get_learning_rate_scheduler(optimizer, args)
        params = [p for p in model.parameters()]
        set_seed(args.seed)
        pipelines = [create_data_pipeline(args, 0, 0, 0, r, ranks) for r in range(ranks)]
        validations: dict[str, float] = {}
        losses, steps = [], 0
        while steps < args.max_steps:
            for pipeline in pipelines:
                pipeline.create_train_dataset()
            for batches in zip(*(p.train_dataloader for p in pipelines)):
                if steps >= args.max_steps:
                    break
                optimizer.zero_grad(set_to_none=True)
                ids = [pipelines[0].get_batch(b)[0] for b in batches]
                if half is None:
                    per_rank = [model(input_ids=x, attention_mask=None, labels=x)["loss"] for x in ids]
                    torch.stack(per_rank).mean().backward()
                else:  # FSDP's MixedPrecision: bf16 copies of the float32 parameters run forward and backward
                    half.load_state_dict(model.state_dict())
                    half.zero_grad(set_to_none=True)
                    per_rank = [half(input_ids=x, attention_mask=None, labels=x)["loss"] for x in ids]
                    torch.stack(per_rank).float().mean().backward()
                    for p, h in zip(model.parameters(), half.parameters()):
                        p.grad = h.grad.float()
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
                optimizer.step()
                scheduler.step()
                losses.append(float(per_rank[0]))
                steps += 1
                if args.validation_freq and steps % args.validation_freq == 0:
                    validations[str(steps - 1)] = validate(pipelines)
                if steps == resumed_at:  # the resumed job's validation loader skips what the saved one had read
                    read = (steps // args.validation_freq) * args.val_batch_size * args.validation_batches
                    for r, pipeline in enumerate(pipelines):
                        pipeline.val_dataloader = create_data_pipeline(args, 0, 0, read, r, ranks).val_dataloader
            if isinstance(pipelines[0], GPTDataPipeline):
                for pipeline in pipelines:
                    pipeline.increment_path_in_epoch()
        return losses, validations

    def validate(pipelines) -> float:
        """``eval_model``: each process's summed loss over ``validation_batches`` batches, all-reduced, over the
        world size and the batches; tensor-parallel peers read the same rows, so it is the data-parallel mean."""
        model.eval()
        with torch.no_grad():
            totals = []
            for pipeline in pipelines:
                batches = [b for _, b in zip(range(args.validation_batches), pipeline.val_dataloader)]
                ids = [pipeline.get_val_batch(b)[0] for b in batches]
                totals.append(sum(float(model(input_ids=x, attention_mask=None, labels=x)["loss"]) for x in ids))
        model.train()
        return sum(totals) / len(totals) / args.validation_batches

    losses, validations = train(bf16=False)
    result = {"losses_rank0": losses, "val_losses": validations, "data_parallel_ranks": ranks}
    if args.bf16:
        result["losses_rank0_torch_bf16"] = train(bf16=True)[0]
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=Path, default=None, help="a clone of aws/amazon-sagemaker-examples")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all but *_8proc)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scripts", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial-weights", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.reference:
        print(json.dumps(reference(options.reference, options.data, options.scripts, options.initial_weights)))
        return
    if options.examples is None:
        print(checkout.how_to_get("benchmarks.smp_v2_examples", checkout.SMP_V2) + "\nSkipped: no --examples DIR.")
        return
    names = options.only or DEFAULT_RUN
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"no configuration {unknown}; there are {list(CONFIGS)}")
    results = json.loads(options.out.read_text()) if options.out.exists() and options.only else {}
    results.setdefault("configurations", {})
    with tempfile.TemporaryDirectory(prefix="smp-v2-examples-") as tmp:
        try:
            scripts = checkout.materialise(options.examples, checkout.SMP_V2, Path(tmp) / "examples")
        except checkout.CheckoutError as e:
            parser.error(str(e))
        results["smp_names_unlisted"] = smp_names.unlisted(sorted(scripts.rglob("*.py")), scripts)
        print(smp_names.status_line(results["smp_names_unlisted"]), flush=True)
        data = make_data(Path(tmp) / "data")
        for name in names:  # one at a time: each runs its processes on every core
            work = Path(tmp) / name
            work.mkdir()
            record = run_config(name, work, data, scripts)
            if record["phases"][0]["finished"]:
                record["reference"] = run_reference(name, data, scripts, Path(record["initial_weights"]))
                record["comparison"] = compare(record, record["reference"])
            else:
                record["reference"], record["comparison"] = None, {"note": "no initial weights: the init run failed"}
            record.pop("initial_weights")
            results["configurations"][name] = record
            print(status_line(name, record), flush=True)
    results["data"] = DATA
    results["jmp_tree"] = jmp_tree()
    results["scripts"] = {"origin": checkout.ORIGIN, "commit": checkout.SMP_V2.commit, "folder": checkout.SMP_V2.folder}
    results["command"] = (
        "python -m jmp.launch -n P --cpu-devices 1 --mp-parameters JSON benchmarks/aws_scripts/smp_v2_host.py "
        "DIR/'      build_and_train_models/sm-distributed_model_parallel_v2/shared-scripts'/train.py ..."
    )
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
