"""Checkpoints: ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` against ``torch.save`` / ``torch.load``.

    python -m benchmarks.checkpoint [--small] [--repeats 3] [--steps 1] [--out benchmarks/results/checkpoint.json]

GPT-2 (Hugging Face, from a config, random weights, nothing downloaded): 124M parameters (12 layers, d_model
768, 12 heads, vocab 50257, 1024 positions), or with ``--small`` 2 layers, d_model 128, 4 heads, vocab 1024;
``torch.optim.AdamW`` (lr 1e-4) through ``smp.DistributedOptimizer`` under ``sharded_data_parallel_degree=8``
on 8 emulated CPU devices, after ``--steps`` training steps on a batch of 8 x 64 tokens (so that AdamW's
moments exist). All in one process, each measurement ``--repeats`` times after one untimed (cold) call, medians:

Save
    ``jmp partial``: ``smp.save_checkpoint(dir, tag, partial=True, model=, optimizer=, user_content=)``: the
    time it blocks (it returns once the arrays are off the devices; Orbax writes in the background) and the
    time until the write is complete (``jmp.saving.wait_for_saves()``). ``jmp full``: ``partial=False`` (the
    model's and optimizer's torch ``state_dict``s gathered and ``torch.save``d). ``torch.save (jmp state)``:
    ``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, file)`` of the jmp model, with
    the gathering timed apart from the writing. ``torch.save (pure torch)``: the same of a plain torch GPT-2 and
    torch AdamW after one torch step, no jmp.

Restore
    Into a freshly built model and optimizer: ``smp.resume_from_checkpoint(dir, tag)`` (partial, and
    ``partial=False`` for the full one); ``torch.load`` + ``load_state_dict`` of the jmp model and optimizer;
    the same for the plain torch model and AdamW. Timed until the restored arrays are ready. Restored values
    are checked against what was saved.

Bytes
    On disk (file sizes) of each checkpoint, against the state: float32 parameters and AdamW's two float32
    moments (3 x 4 bytes per parameter) plus step counts.

Files go to a temporary directory (``--dir``) removed at the end. Nothing is fsync'ed by either side: a write
is complete when it is in the page cache, and restores read what was just written (from the page cache).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint
import torch
import transformers

import jmp as smp
import jmp.saving
from benchmarks.harness import causal_lm, emulate_devices, gpt2_config, lm_step, machine, token_ids, write_results

SIZES = {
    "124M": dict(vocab=50257, positions=1024, d_model=768, layers=12, heads=12),
    "small": dict(vocab=1024, positions=1024, d_model=128, layers=2, heads=4),
}
BATCH, SEQUENCE, LR = 8, 64, 1e-4
FSDP = 8
ORBAX = getattr(orbax.checkpoint, "__version__", "?")
MIB = 2**20
USER_CONTENT = {"step": 1, "epoch": 0, "lr_scheduler": {"last_epoch": 1, "base_lrs": [LR]}}


def gpt2(size: str) -> torch.nn.Module:
    return causal_lm(gpt2_config(**SIZES[size]))


def build(size: str):
    """(DistributedModel, DistributedOptimizer) of a fresh GPT-2 of ``size`` under fsdp over 8 devices."""
    smp.init({"sharded_data_parallel_degree": FSDP})
    model = smp.DistributedModel(gpt2(size))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, optimizer


def train(model, optimizer, ids: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(float(lm_step(model, ids).reduce_mean()))
        optimizer.step()
    ready(model, optimizer)
    return losses


def ready(model, optimizer) -> None:
    jax.block_until_ready((model.training_state.params, model.training_state.rest, optimizer.opt_state))


# --- measuring ------------------------------------------------------------------------------------------------


def timed(call: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> dict:
    """Seconds of a first (cold) call and of ``repeats`` more, the median of those; ``before`` runs untimed first."""
    samples = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return summary(samples)


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples[1:]), "cold": samples[0], "seconds": samples[1:]}


def disk_bytes(path: Path) -> int:
    """Bytes of the files at ``path`` (a file, or a directory's files, recursively)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tree_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))


def max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference between the tensors of two (nested) state dicts with the same keys."""
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        if isinstance(x, dict):
            worst = max(worst, max_difference(x, y))
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            worst = max(worst, (x.float() - torch.as_tensor(y).float()).abs().max().item())
    return worst


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --- pure torch ---------------------------------------------------------------------------------------------------


def pure_torch(size: str, ids: torch.Tensor, work: Path, repeats: int) -> dict:
    """``torch.save`` / ``torch.load`` of a plain GPT-2 and AdamW after one torch step."""
    module = gpt2(size)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    optimizer.zero_grad()
    module(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    file = work / "pure_torch.pt"

    saved = timed(
        lambda m=module, o=optimizer: torch.save({"model": m.state_dict(), "optimizer": o.state_dict()}, file), repeats
    )
    reference = {"model": module.state_dict(), "optimizer": optimizer.state_dict()["state"]}
    n_params = sum(p.numel() for p in module.parameters())
    del module, optimizer
    gc.collect()

    target = {}

    def before():
        target.clear()
        target["module"] = gpt2(size)
        target["optimizer"] = torch.optim.AdamW(target["module"].parameters(), lr=LR)

    def restore():
        state = torch.load(file, weights_only=True)
        target["module"].load_state_dict(state["model"])
        target["optimizer"].load_state_dict(state["optimizer"])

    restored = timed(restore, repeats, before=before)
    difference = max(
        max_difference(reference["model"], target["module"].state_dict()),
        max_difference(reference["optimizer"], target["optimizer"].state_dict()["state"]),
    )
    return {
        "save": saved,
        "restore": restored,
        "disk_bytes": disk_bytes(file),
        "parameters": n_params,
        "restored_max_abs_difference": difference,
    }


# --- jmp ----------------------------------------------------------------------------------------------------------


def jmp_saves(model, optimizer, work: Path, repeats: int) -> dict:
    partial_root, full_root, torch_file = work / "partial", work / "full", work / "jmp_state.pt"
    blocking, total = [], []
    for _ in range(repeats + 1):
        fresh(partial_root)
        start = time.perf_counter()
        smp.save_checkpoint(
            partial_root, "step1", partial=True, model=model, optimizer=optimizer, user_content=USER_CONTENT
        )
        blocking.append(time.perf_counter() - start)
        jmp.saving.wait_for_saves()
        total.append(time.perf_counter() - start)

    full = timed(
        lambda: smp.save_checkpoint(full_root, "step1", partial=False, model=model, optimizer=optimizer),
        repeats,
        before=lambda: fresh(full_root),
    )

    gather, write = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        gathered = time.perf_counter()
        torch.save(state, torch_file)
        write.append(time.perf_counter() - gathered)
        gather.append(gathered - start)
    return {
        "partial_blocking": summary(blocking),
        "partial_total": summary(total),
        "full": full,
        "torch_save_gather": summary(gather),
        "torch_save_write": summary(write),
        "torch_save_total": summary([g + w for g, w in zip(gather, write)]),
        "disk_bytes": {
            "partial": disk_bytes(partial_root / "step1_partial"),
            "full": sum(disk_bytes(full_root / name) for name in ("step1", "optimizer_step1")),
            "torch_save": disk_bytes(torch_file),
        },
        "reference": {"model": state["model"], "optimizer": state["optimizer"]["state"]},
    }


def jmp_restores(size: str, work: Path, repeats: int, reference: dict) -> dict:
    """Each kind of restore into a model and optimizer built fresh (and untimed) before each call."""
    holder: dict = {}

    def before():
        holder.clear()
        gc.collect()  # resume_from_checkpoint loads into the one live DistributedModel
        holder["model"], holder["optimizer"] = build(size)

    def check() -> dict:
        return {
            "model": max_difference(reference["model"], holder["model"].state_dict()),
            "optimizer": max_difference(reference["optimizer"], holder["optimizer"].state_dict()["state"]),
        }

    def partial():
        content = smp.resume_from_checkpoint(work / "partial", tag="step1")
        ready(holder["model"], holder["optimizer"])
        assert content == USER_CONTENT, content

    def full():
        smp.resume_from_checkpoint(work / "full", tag="step1", partial=False)
        ready(holder["model"], holder["optimizer"])

    def torch_file():
        state = torch.load(work / "jmp_state.pt", weights_only=True)
        holder["model"].load_state_dict(state["model"])
        holder["optimizer"].load_state_dict(state["optimizer"])
        ready(holder["model"], holder["optimizer"])

    before()
    out: dict = {"fresh_model_max_abs_difference": check()}  # what the checks below would say without a restore
    for name, call in (("partial", partial), ("full", full), ("torch_load", torch_file)):
        out[name] = timed(call, repeats, before=before)
        out[name]["restored_max_abs_difference"] = check()
    holder.clear()
    return out


# --- output -------------------------------------------------------------------------------------------------------


def notes(saves: dict, restores: dict, plain: dict, state_bytes: int, tied_bytes: int) -> list[str]:
    """What the numbers say, from the numbers of this run."""
    disk = saves["disk_bytes"]
    blocking, total = saves["partial_blocking"]["median"], saves["partial_total"]["median"]
    timings = [v for v in [*saves.values(), *restores.values(), plain["save"], plain["restore"]] if "seconds" in v]
    spread = max(max(v["seconds"]) / min(v["seconds"]) for v in timings)
    return [
        f"save_checkpoint(partial=True) blocks {blocking:.2f}s of the {total:.2f}s the write takes "
        f"({blocking / total:.0%}); the rest runs in Orbax's background threads, here competing with nothing "
        "(the benchmark waits). The whole write takes "
        f"{total / saves['torch_save_total']['median']:.2f}x the time of gathering the state_dicts and torch.save "
        "of them: Orbax's tensorstore compresses every chunk (zarr3, zstd level 3) before writing it into OCDBT "
        "files, on the same 2 CPU cores.",
        f"the partial checkpoint holds {disk['partial'] / state_bytes:.2f}x the bytes of the state "
        f"({disk['partial'] / MIB:.1f} of {state_bytes / MIB:.1f} MiB): zstd compression (random float32 weights "
        "and fresh AdamW moments compress a little), plus JSON metadata.",
        (
            f"jmp's model.state_dict() returns the tied embedding twice (transformer.wte.weight and lm_head.weight "
            f"as separate tensors, {tied_bytes / MIB:.1f} MiB), where torch's share storage and torch.save writes "
            f"it once: the full checkpoint and the torch file of the jmp state are {disk['torch_save'] / MIB:.1f} "
            f"MiB against {plain['disk_bytes'] / MIB:.1f} MiB for pure torch."
            if disk["torch_save"] > 1.02 * plain["disk_bytes"]
            else f"the full checkpoint holds the tied embedding ({tied_bytes / MIB:.1f} MiB) once, as torch's does: "
            f"{disk['full'] / MIB:.1f} MiB against {plain['disk_bytes'] / MIB:.1f} MiB for pure torch."
        ),
        "restores are timed into a freshly built model and optimizer (built untimed) until the arrays are "
        "ready, reading files the page cache holds. Restored values against what was saved, max abs difference: "
        f"partial {restores['partial']['restored_max_abs_difference']}, full "
        f"{restores['full']['restored_max_abs_difference']}, torch.load "
        f"{restores['torch_load']['restored_max_abs_difference']} (a fresh model and optimizer, not restored: "
        f"{restores['fresh_model_max_abs_difference']}).",
        f"2-core machine, shared with other jobs: single timings vary (up to {spread:.1f}x between samples of one "
        f"measurement here); medians of {len(saves['partial_total']['seconds'])} after a cold call.",
    ]


def table(jmp_save: dict, jmp_restore: dict, plain: dict) -> str:
    rows = [
        ("jmp partial (blocking)", jmp_save["partial_blocking"], None, None),
        ("jmp partial (until written)", jmp_save["partial_total"], jmp_restore["partial"], "partial"),
        ("jmp full (partial=False)", jmp_save["full"], jmp_restore["full"], "full"),
        ("torch.save jmp state_dicts", jmp_save["torch_save_total"], jmp_restore["torch_load"], "torch_save"),
        ("  of which gathering", jmp_save["torch_save_gather"], None, None),
        ("  of which torch.save", jmp_save["torch_save_write"], None, None),
        ("torch.save pure torch", plain["save"], plain["restore"], None),
    ]
    header = f"{'':<30}{'save s':>9}{'cold s':>9}{'restore s':>11}{'cold s':>9}{'MiB':>9}"
    lines = [header, "-" * len(header)]
    for name, save, restore, disk in rows:
        size = plain["disk_bytes"] if name.startswith("torch.save pure") else jmp_save["disk_bytes"].get(disk)
        lines.append(
            f"{name:<30}{save['median']:>9.3f}{save['cold']:>9.3f}"
            + (f"{restore['median']:>11.3f}{restore['cold']:>9.3f}" if restore else f"{'':>20}")
            + (f"{size / MIB:>9.1f}" if size is not None else "")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="2 layers, d_model 128, vocab 1024: a quick check")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each measurement (after a cold one)")
    parser.add_argument("--steps", type=int, default=1, help="training steps before saving")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/checkpoint[_small].json")
    args = parser.parse_args()
    size = "small" if args.small else "124M"
    out = args.out or f"benchmarks/results/checkpoint{'_small' if args.small else ''}.json"
    transformers.logging.set_verbosity_error()
    emulate_devices(FSDP)
    start = time.perf_counter()
    ids = token_ids(BATCH, SEQUENCE, SIZES[size]["vocab"])
    work = Path(tempfile.mkdtemp(prefix="jmp_checkpoint_bench_", dir=args.dir))
    try:
        plain = pure_torch(size, ids, work, args.repeats)
        print(f"pure torch measured ({time.perf_counter() - start:.0f}s)", flush=True)

        model, optimizer = build(size)
        losses = train(model, optimizer, ids, args.steps)
        n_params = model.layout.parameter_count()
        state = {
            "params": tree_bytes(model.training_state.params),
            "buffers": tree_bytes(model.training_state.rest),
            "optimizer": tree_bytes(optimizer.opt_state),
        }
        print(f"trained {args.steps} step(s), loss {losses} ({time.perf_counter() - start:.0f}s)", flush=True)
        saves = jmp_saves(model, optimizer, work, args.repeats)
        reference = saves.pop("reference")
        del model, optimizer
        print(f"jmp saves measured ({time.perf_counter() - start:.0f}s)", flush=True)
        restores = jmp_restores(size, work, args.repeats, reference)
        print(f"jmp restores measured ({time.perf_counter() - start:.0f}s)", flush=True)
    finally:
        jmp.saving.wait_for_saves()
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - start

    state_bytes = sum(state.values())
    disk = saves["disk_bytes"]
    torch_save = saves["torch_save_total"]["median"]
    ratios = {
        "partial_blocking_over_torch_save": saves["partial_blocking"]["median"] / torch_save,
        "partial_total_over_torch_save": saves["partial_total"]["median"] / torch_save,
        "partial_blocking_over_pure_torch_save": saves["partial_blocking"]["median"] / plain["save"]["median"],
        "partial_total_over_pure_torch_save": saves["partial_total"]["median"] / plain["save"]["median"],
        "full_over_torch_save": saves["full"]["median"] / torch_save,
        "partial_restore_over_torch_load": restores["partial"]["median"] / restores["torch_load"]["median"],
        "partial_restore_over_pure_torch_load": restores["partial"]["median"] / plain["restore"]["median"],
        "partial_bytes_over_state": disk["partial"] / state_bytes,
        "partial_bytes_over_torch_file": disk["partial"] / disk["torch_save"],
        "partial_bytes_over_pure_torch_file": disk["partial"] / plain["disk_bytes"],
    }

    print()
    print(table(saves, restores, plain))
    print(
        f"\nparameters {n_params:,}; state {state_bytes / MIB:.1f} MiB (params {state['params'] / MIB:.1f}, buffers "
        f"{state['buffers'] / MIB:.1f}, AdamW {state['optimizer'] / MIB:.1f}); 12 B x params = "
        f"{12 * n_params / MIB:.1f} MiB"
    )
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    tied_bytes = reference["model"]["lm_head.weight"].nbytes
    findings = notes(saves, restores, plain, state_bytes, tied_bytes)
    print("\n" + "\n".join(f"- {line}" for line in findings))
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**machine(), "transformers": transformers.__version__, "orbax": ORBAX},
        "config": dict(
            size=size,
            **SIZES[size],
            batch=BATCH,
            sequence=SEQUENCE,
            optimizer="AdamW",
            lr=LR,
            mesh=f"fsdp={FSDP}",
            training_steps=args.steps,
            repeats=args.repeats,
            cold_calls=1,
        ),
        "notes": findings,
        "parameters": n_params,
        "losses": losses,
        "state_bytes": {**state, "total": state_bytes, "12_bytes_per_parameter": 12 * n_params},
        "disk_bytes": {**disk, "pure_torch": plain["disk_bytes"]},
        "save_seconds": {k: v for k, v in saves.items() if k != "disk_bytes"},
        "restore_seconds": restores,
        "pure_torch": plain,
        "ratios": ratios,
        "seconds": seconds,
    }
    write_results(out, result)
    print(f"\nwrote {out} ({seconds:.0f}s)")


if __name__ == "__main__":
    main()
