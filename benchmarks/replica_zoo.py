"""The Hugging Face zoo under data parallelism with microbatches: gradients kept per replica through the microbatch
loop and reduced once after it (``jmp.compiled_step.replica_gradients``) against the plain loop, architecture by
architecture.

For each architecture of a family (``benchmarks/hf_zoo_models.py``: the default config made tiny, built with no
download; PyTorch must run it, else the row is ``torch_fails``), one subprocess with a time limit and 8 emulated CPU
devices tiles the inputs to 16 rows (every tensor whose first dimension is the batch, repeated along it), puts the
model in eval mode (no dropout: neither form draws random numbers) and runs one ``@smp.step`` (``loss =
model(**inputs).loss; model.backward(loss)``) under ``smp.init({"microbatches": 2, "ddp": True})`` twice: with the
per-replica gradients (the default) and, on a deep copy of the torch model made before either conversion (built
again with the same weights where it cannot be copied), with the plain loop (``replica_gradients.replicated_axes``
patched to ``()`` while the step compiles, as ``benchmarks/gradient_reduction.py`` does). Each row records the
status (``pass``: the losses within 1e-5 and every gradient within 1e-4 of the plain loop's, relative to the
gradient's largest magnitude with a floor of 1e-3 of the largest gradient; ``mismatch``; ``error``, with the
exception's first line and which form raised; ``timeout``; ``crash``), the largest gradient difference and its
parameter, the loss difference, whether the step kept replica copies at all (``replica_axes``) and the bytes of the
all-reduces inside the compiled step's while-loop bodies and outside them for both forms (none for a step run op by
op, which keeps no replica copies). A form that raised where the other did not keeps its traceback's last lines
(``replica_only_error``: a regression of the feature). The summary counts the statuses and gives the median ratio of
in-loop all-reduce bytes, replica over plain. Results in ``benchmarks/results/replica_zoo.json``, resumable:
architectures already there are skipped unless ``--rerun``. Architectures run fastest first by their time in
``benchmarks/results/hf_zoo.json`` (whose shrink level each starts from); those PyTorch failed there, last.

    python -m benchmarks.replica_zoo --limit 20
    python -m benchmarks.replica_zoo --family masked_lm --limit 15
    python -m benchmarks.replica_zoo --only causal_lm/llama,causal_lm/gpt2 --rerun
    python -m benchmarks.replica_zoo --report

With ``--scan-layers`` both forms run under ``scan_layers`` (repeated layers as one scan, their weights stored
stacked where they stack; ``stacked``: the model's store kept some), results in
``benchmarks/results/replica_zoo_scanned.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from benchmarks import hf_zoo

ZOO_RESULTS = Path(__file__).parent / "results" / "hf_zoo.json"
RESULTS = Path(__file__).parent / "results" / "replica_zoo.json"
SCANNED_RESULTS = Path(__file__).parent / "results" / "replica_zoo_scanned.json"
SCAN_ENV = "JMP_REPLICA_ZOO_SCAN_LAYERS"  # the worker runs both forms under scan_layers
TIMEOUT_S = 240
DEVICES, ROWS, MICROBATCHES = 8, 16, 2
LOSS_RTOL, GRAD_RTOL, FLOOR = 1e-5, 1e-4, 1e-3
FORMS = ("replica", "plain")


# --- one architecture (the worker process) ----------------------------------------------------------------------


def _tiled(inputs: dict, batch: int, rows: int) -> dict:
    """Every tensor whose first dimension is ``batch`` repeated along it to ``rows`` rows; the rest as they are."""
    import torch

    return {
        k: v.repeat(rows // batch, *[1] * (v.dim() - 1)) if isinstance(v, torch.Tensor) and v.dim() and len(v) == batch
        else v
        for k, v in inputs.items()
    }  # fmt: skip


def _torch_model(family: str, model_type: str, hint: tuple | None) -> tuple[Any, dict, dict, Any]:
    """The first shrunk model PyTorch runs (the zoo's shrink level first), its inputs, how it was shrunk and a
    function that builds it again."""
    from benchmarks import hf_zoo_models as zoo

    class_name = zoo.architectures(family)[model_type]
    images = (zoo.IMAGE, 2 * zoo.IMAGE) if zoo._default_has_image(model_type) else (zoo.IMAGE,)
    attempts = [(level, by, image) for image in images for level in range(zoo.SHRINK_LEVELS) for by in (False, True)]
    if hint in attempts:
        attempts.remove(hint)
        attempts.insert(0, hint)
    first_error = None
    for level, by, image in attempts:
        try:
            shrunk_as = (level, by, image)
            model, inputs, _, _ = zoo._torch_run(family, model_type, class_name, *shrunk_as)
            shrunk = {"class": class_name, "shrink_level": level, "shrunk_by_attributes": by, "image_size": image}
            return model, inputs, shrunk, functools.partial(zoo._torch_run, family, model_type, class_name, *shrunk_as)
        except Exception as error:  # noqa: BLE001 - PyTorch fails on every shrunk config: excluded
            first_error = first_error or error
    raise _TorchFails(first_error)


class _TorchFails(Exception):
    pass


@contextlib.contextmanager
def _form(replica: bool, seen: list):
    """Steps compiled meanwhile keep per-replica gradients (``replica``) or run the plain loop; ``seen`` collects
    the axes ``replicated_axes`` answered."""
    from jmp.compiled_step import replica_gradients

    original = replica_gradients.replicated_axes

    def recorded(model, signature):
        axes = original(model, signature) if replica else ()
        seen.append(list(axes))
        return axes

    replica_gradients.replicated_axes = recorded
    try:
        yield
    finally:
        replica_gradients.replicated_axes = original


def _run_form(model: Any, inputs: dict, replica: bool) -> dict:
    """One ``@smp.step`` of a fresh DistributedModel of ``model``: losses per microbatch, gradients by name, the
    all-reduce bytes of the compiled program; or the error."""
    import numpy as np

    import jmp as smp
    from benchmarks.harness import all_reduce_bytes, named_grads
    from jmp.errors import StepError

    @smp.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    seen: list = []
    try:
        with _form(replica, seen):
            smp.init({"microbatches": MICROBATCHES, "ddp": True, "scan_layers": bool(os.environ.get(SCAN_ENV))})
            distributed = smp.DistributedModel(model)
            distributed.eval()
            losses = np.asarray(train_step(distributed, inputs).stack().float().numpy(), dtype=np.float64)
            grads = {k: np.asarray(v, dtype=np.float64) for k, v in named_grads(distributed.grads).items()}
            try:
                hlo = train_step.lower(distributed, inputs).compile().as_text()
            except StepError as error:  # a step run op by op has no program (nor replica copies)
                if "runs op by op" not in str(error):
                    raise
                hlo = None
    except Exception as error:  # noqa: BLE001 - recorded as the form's failure
        lines = str(error).strip().splitlines()
        return {
            "error_type": type(error).__name__,
            "error": (lines or [""])[0][:400],
            "traceback_tail": traceback.format_exc().strip().splitlines()[-10:],
        }
    axes = next((a for a in seen if a), [])
    return {
        "losses": losses,
        "grads": grads,
        "all_reduce_bytes": all_reduce_bytes(hlo) if hlo is not None else None,
        "replica_axes": axes,
        "path": "compiled" if hlo is not None else "op by op",
        "stacked": bool(getattr(distributed.store, "groups", None)),
    }


def _difference(actual: Any, expected: Any, floor: float) -> float:
    """Largest |actual - expected| over max(largest |expected|, floor); inf where they differ in NaN or inf."""
    import numpy as np

    if actual.shape != expected.shape:
        return float("inf")
    if not expected.size or np.array_equal(actual, expected, equal_nan=True):
        return 0.0
    if not (np.isfinite(actual).all() and np.isfinite(expected).all()):
        return float("inf")
    scale = max(float(np.max(np.abs(expected))), floor, 1e-30)
    return float(np.max(np.abs(actual - expected))) / scale


def compare(replica: dict, plain: dict) -> dict:
    """The replica form's losses and gradients against the plain loop's."""
    import numpy as np

    names = sorted(set(plain["grads"]) | set(replica["grads"]))
    largest = max((float(np.max(np.abs(g))) for g in plain["grads"].values() if g.size), default=0.0)
    errors = {
        n: _difference(replica["grads"][n], plain["grads"][n], FLOOR * largest) if n in replica["grads"] and
        n in plain["grads"] else float("inf")
        for n in names
    }  # fmt: skip
    worst = max(errors, key=errors.get) if errors else None
    loss_error = _difference(replica["losses"], plain["losses"], 1e-12)
    figures = {
        "loss": float(np.mean(plain["losses"])),
        "loss_replica": float(np.mean(replica["losses"])),
        "loss_rel_diff": loss_error,
        "max_grad_rel_diff": errors[worst] if worst else None,
        "worst_gradient": worst,
        "worst_gradient_shape": list(plain["grads"][worst].shape) if worst in plain["grads"] else None,
        "largest_gradient": largest,
        "gradients": len(names),
        "gradients_over_tolerance": sorted(n for n, e in errors.items() if not e <= GRAD_RTOL)[:10],
    }
    passed = loss_error <= LOSS_RTOL and all(e <= GRAD_RTOL for e in errors.values())
    return {"status": "pass" if passed else "mismatch", **figures}


def check(family: str, model_type: str, hint: tuple | None = None) -> dict:
    """One architecture: its step with per-replica gradients and with the plain loop, compared."""
    import torch

    row: dict[str, Any] = {"family": family, "model_type": model_type}
    try:
        model, inputs, shrunk, rebuild = _torch_model(family, model_type, hint)
    except _TorchFails as failure:
        error = failure.args[0]
        lines = str(error).strip().splitlines()
        return {**row, "status": "torch_fails", "error_type": type(error).__name__, "error": (lines or [""])[0][:400]}
    row.update(shrunk, parameters=sum(p.numel() for p in model.parameters()))
    model.eval()
    model.zero_grad(set_to_none=True)
    batch = next(len(v) for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim())
    inputs = _tiled(inputs, batch, ROWS)
    try:
        twin = copy.deepcopy(model)  # the plain loop's copy, before either conversion
    except RuntimeError:  # a tensor that is not a graph leaf (a state its forward kept): the same model again
        twin = rebuild()[0].eval()
        twin.load_state_dict(model.state_dict())
        row["plain_model"] = "rebuilt"
    forms = {"replica": _run_form(model, inputs, True), "plain": _run_form(twin, inputs, False)}
    row["all_reduce_bytes"] = {f: forms[f].get("all_reduce_bytes") for f in FORMS}
    row["replica_axes"] = forms["replica"].get("replica_axes")
    row["stacked"] = forms["replica"].get("stacked")
    row["path"] = {f: forms[f].get("path") for f in FORMS}
    failed = [f for f in FORMS if "error" in forms[f]]
    if not failed:
        return {**row, **compare(forms["replica"], forms["plain"])}
    first = forms[failed[0]]
    row.update(status="error", failed=" and ".join(failed), error_type=first["error_type"], error=first["error"])
    if failed == ["replica"]:
        row["replica_only_error"] = True
    if len(failed) == 1:
        row["traceback_tail"] = first["traceback_tail"]
    return row


# --- the sweep ----------------------------------------------------------------------------------------------------


def _zoo_rows() -> dict:
    return json.loads(ZOO_RESULTS.read_text())["architectures"] if ZOO_RESULTS.exists() else {}


def _ordered_keys(families: list[str]) -> list[str]:
    """Each family's architectures, fastest in the zoo sweep first; those PyTorch failed there (or not swept), last."""
    zoo = _zoo_rows()

    def order(key: str) -> tuple:
        row = zoo.get(key)
        runs = row is not None and row["status"] != "torch_fails"
        return (not runs, row.get("seconds", 0) if runs else 0, key)

    return sorted(hf_zoo._all_keys(families), key=order)


def run_one(key: str, timeout_s: int, scan_layers: bool = False) -> dict:
    """``check`` for one ``family/model_type`` in a fresh process with 8 CPU devices and its own compilation cache
    (the call after ``lower().compile()`` loads the program from it); its JSON row, or a timeout / crash row."""
    family, model_type = key.split("/", 1)
    zoo = _zoo_rows().get(key, {})
    spec = key
    if "shrink_level" in zoo:
        hint = (zoo["shrink_level"], int(bool(zoo.get("shrunk_by_attributes"))), zoo.get("image_size", 0))
        spec += "/" + "/".join(str(v) for v in hint)
    command = [sys.executable, "-m", "benchmarks.replica_zoo", "--worker", spec]
    cache = tempfile.mkdtemp(prefix="replica_zoo_xla_")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
        "JMP_COMPILATION_CACHE": cache,
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
        **({SCAN_ENV: "1"} if scan_layers else {}),
    }
    try:
        return hf_zoo.run_worker(command, env, {"family": family, "model_type": model_type}, timeout_s, tail_lines=5)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _worker(spec: str) -> dict:
    from benchmarks.hf_zoo_models import IMAGE

    family, model_type, *hint = spec.split("/")
    level, by, image = (int(v) for v in hint) if hint else (0, 0, 0)
    return check(family, model_type, (level, bool(by), image or IMAGE) if hint else None)


def summarise(rows: dict[str, dict]) -> dict:
    """Counts by status; mismatches and replica-only errors with their figures; the in-loop all-reduce bytes."""
    counts = collections.Counter(r["status"] for r in rows.values())
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows.values():
        by_family[row["family"]][row["status"]] += 1
    compared = [r["max_grad_rel_diff"] for r in rows.values() if r.get("max_grad_rel_diff") is not None]
    ratios, step_ratios, engaged = [], [], 0
    for row in rows.values():
        bytes_ = row.get("all_reduce_bytes") or {}
        engaged += bool(row.get("replica_axes"))
        if bytes_.get("replica") and bytes_.get("plain") and bytes_["plain"]["in_loop"]:
            ratios.append(bytes_["replica"]["in_loop"] / bytes_["plain"]["in_loop"])
            per_step = {f: MICROBATCHES * b["in_loop"] + b["outside_loop"] for f, b in bytes_.items()}
            step_ratios.append(per_step["replica"] / per_step["plain"])
    mismatches = {
        k: {f: r.get(f) for f in ("loss_rel_diff", "max_grad_rel_diff", "worst_gradient", "worst_gradient_shape")}
        for k, r in sorted(rows.items())
        if r["status"] == "mismatch"
    }
    replica_only = {k: r["error"] for k, r in sorted(rows.items()) if r.get("replica_only_error")}
    errors = {k: f"{r.get('failed')}: {r['error']}"[:200] for k, r in sorted(rows.items()) if r["status"] == "error"}
    return {
        "swept": len(rows),
        "by_status": dict(sorted(counts.items())),
        "by_family": {family: dict(sorted(c.items())) for family, c in sorted(by_family.items())},
        "largest_grad_rel_diff": max(compared, default=None),
        "replica_copies_used": engaged,
        "median_in_loop_all_reduce_ratio": statistics.median(ratios) if ratios else None,
        "in_loop_ratio_models": len(ratios),
        # all-reduce bytes one step moves (the loop body's once per microbatch), replica / plain
        "median_step_all_reduce_ratio": statistics.median(step_ratios) if step_ratios else None,
        "mismatches": mismatches,
        "replica_only_errors": replica_only,
        "errors": errors,
        "timeouts_and_crashes": sorted(k for k, r in rows.items() if r["status"] in ("timeout", "crash")),
        "op_by_op": sorted(k for k, r in rows.items() if "op by op" in (r.get("path") or {}).values()),
        "stacked_storage": sum(bool(r.get("stacked")) for r in rows.values()),
    }


def _load(path: Path) -> dict:
    return hf_zoo.load_results(path)


def _save(path: Path, results: dict) -> None:
    hf_zoo.save_results(path, results, summarise)


def print_report(summary: dict) -> None:
    print(
        f"swept {summary['swept']}: {summary['by_status']}; replica copies used in {summary['replica_copies_used']}",
        end="",
    )
    print(f", weights stored stacked in {summary.get('stacked_storage', 0)}")
    for family, counts in summary["by_family"].items():
        print(f"  {family}: {counts}")
    print(f"largest gradient difference, relative: {summary['largest_grad_rel_diff']}")
    print(f"median in-loop all-reduce bytes, replica / plain: {summary['median_in_loop_all_reduce_ratio']}", end="")
    print(f" (over {summary['in_loop_ratio_models']} models)")
    for key, figures in summary["mismatches"].items():
        print(f"mismatch {key}: {figures}")
    for key, error in summary["replica_only_errors"].items():
        print(f"replica-only error {key}: {error}")
    for key, error in summary["errors"].items():
        print(f"error {key}: {error}")
    if summary["op_by_op"]:
        print(f"run op by op (no program, no replica copies): {', '.join(summary['op_by_op'])}")
    if summary["timeouts_and_crashes"]:
        print(f"timeouts and crashes: {', '.join(summary['timeouts_and_crashes'])}")


def main(argv: list[str] | None = None) -> None:
    from benchmarks.hf_zoo_models import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="families to sweep (causal_lm)")
    parser.add_argument("--only", help="comma-separated family/model_type keys")
    parser.add_argument("--limit", type=int, help="at most this many architectures this run")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--rerun", action="store_true", help="run architectures already in the results again")
    parser.add_argument("--report", action="store_true", help="print the summary of the saved results and stop")
    parser.add_argument("--scan-layers", action="store_true", help="both forms under scan_layers (own results)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker)), flush=True)
        return
    path = SCANNED_RESULTS if args.scan_layers else RESULTS
    results = _load(path)
    if args.report:
        print_report(summarise(results["architectures"]))
        return
    keys = args.only.split(",") if args.only else _ordered_keys(args.family or ["causal_lm"])
    if not args.rerun:
        keys = [k for k in keys if k not in results["architectures"]]
    for key in keys[: args.limit] if args.limit else keys:
        row = run_one(key, args.timeout, args.scan_layers)
        results["architectures"][key] = row
        _save(path, results)
        diff = row.get("max_grad_rel_diff")
        figures = f"grad {diff:.1e} loss {row['loss_rel_diff']:.1e}" if diff is not None else row.get("error", "")
        print(f"{key:48} {row['status']:11} {row.get('seconds', '')}s  {figures[:110]}", flush=True)
    print_report(summarise(results["architectures"]))


if __name__ == "__main__":
    main()
