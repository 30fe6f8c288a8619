"""The Hugging Face causal-LM zoo with ``scan_layers`` on: one training step through ``smp.DistributedModel`` and
``@smp.step``, PyTorch's loss and gradients against jmp's, and whether the layer stack ran as one scan.

For each causal-LM architecture that passes the zoo sweep (``benchmarks/results/hf_zoo.json``), one subprocess
with a time limit and one XLA device builds the model from ``hf_zoo_models``' shrunk config with enough layers to
scan (4; ``3 * period`` when its layers come in kinds in turn, 6 for two kinds), runs ``model(**inputs).loss`` and
``model.backward(loss)`` in one ``@smp.step`` under ``smp.init({"scan_layers": True})`` and compares the loss and
every gradient with PyTorch's at the zoo's tolerance. Each row records the status (``pass``, or a failure with its
category: ``op``, ``construct``, ``leaked_tracer``, ``numerics``, ``timeout``, ``crash``), the ``scan`` equations
in the step's jaxpr, the stacks jmp found and, for a stack not scanned, why (the ``jmp`` logger's "layer stack ...
run one by one: ..." lines, or no stack found). Results in ``benchmarks/results/hf_zoo_scan.json``, resumable.

    python -m benchmarks.hf_zoo_scan --limit 20
    python -m benchmarks.hf_zoo_scan --only llama,gemma2 --rerun
    python -m benchmarks.hf_zoo_scan --report
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import hf_zoo

ZOO_RESULTS = Path(__file__).parent / "results" / "hf_zoo.json"
RESULTS = Path(__file__).parent / "results" / "hf_zoo_scan.json"
TIMEOUT_S = 150
FAMILY = "causal_lm"
MIN_LAYERS = 4
PERIODS_SCANNED = 3  # a stack of layer kinds in turn: its first period runs as it is, the next ones scan


def passing_architectures() -> list[str]:
    """The causal-LM model types that pass the zoo sweep, fastest there first."""
    rows = json.loads(ZOO_RESULTS.read_text())["architectures"].values()
    passing = [r for r in rows if r["family"] == FAMILY and r["status"] == "pass"]
    return [r["model_type"] for r in sorted(passing, key=lambda r: (r.get("seconds", 0), r["model_type"]))]


# --- one architecture (the worker process) ----------------------------------------------------------------------


@contextlib.contextmanager
def _layer_count(layers: int) -> Iterator[None]:
    """``hf_zoo_models``' shrinking with ``layers`` layers instead of its default."""
    from benchmarks import hf_zoo_models

    default = hf_zoo_models.LAYERS
    hf_zoo_models.LAYERS = layers
    try:
        yield
    finally:
        hf_zoo_models.LAYERS = default


def _period(model: Any) -> int:
    """How many layer kinds the model's longest stack holds in turn (1: its last layers are alike)."""
    from jmp.stacks import find_stacks

    stacks = find_stacks(model)
    if not stacks:
        return 1
    signatures = max(stacks, key=lambda s: len(s.paths)).signatures
    return next((p for p in range(1, len(signatures)) if signatures[-1] == signatures[-1 - p]), 1)


def _torch_model(
    model_type: str, shrink_level: int, by_attributes: bool, layers: int = 0
) -> tuple[Any, dict, float, dict, int]:
    """PyTorch's model, inputs, loss and gradients with enough layers to scan (or ``layers``), and its period."""
    from benchmarks.hf_zoo_models import IMAGE, _torch_run, architectures

    class_name = architectures(FAMILY)[model_type]
    arguments = (FAMILY, model_type, class_name, shrink_level, by_attributes, IMAGE)
    with _layer_count(layers or MIN_LAYERS):
        model, inputs, loss, expected = _torch_run(*arguments)
    period = _period(model)
    if period > 1 and not layers:
        with _layer_count(max(MIN_LAYERS, PERIODS_SCANNED * period)):
            model, inputs, loss, expected = _torch_run(*arguments)
    return model, inputs, float(loss), expected, period


class _StackLines(logging.Handler):
    """The ``jmp`` logger's lines about layer stacks."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("layer stack"):
            self.lines.append(message)


def _scan_equations(jaxpr: Any) -> int:
    """``scan`` equations in ``jaxpr`` and the jaxprs inside its equations."""
    import jax.extend.core as jex

    count, todo = 0, [jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            count += eqn.primitive.name == "scan"
            todo.extend(j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j for j in jex.jaxprs_in_params(eqn.params))
    return count


def _failure(stage: str, error: BaseException) -> dict:
    import jax

    from benchmarks import hf_zoo_models

    row = hf_zoo_models._failure(stage, error)
    if isinstance(error, jax.errors.UnexpectedTracerError) or "Tracer" in type(error).__name__:
        row["category"] = "leaked_tracer"
    return row


def _jmp_step(model: Any, inputs: dict) -> tuple[Any, float, dict, int]:
    """jmp's DistributedModel of ``model``, its loss and gradients by torch name after one ``@smp.step``, and the
    ``scan`` equations of the step's jaxpr."""
    import jmp as smp
    from benchmarks.harness import named_grads

    @smp.step
    def train_step(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    smp.init({"scan_layers": True})
    distributed = smp.DistributedModel(model)
    loss = float(train_step(distributed, inputs).reduce_mean())
    grads = named_grads(distributed.grads)
    return distributed, loss, grads, _scan_equations(train_step.trace(distributed, inputs).jaxpr)


def _compare(loss: float, expected_loss: float, actual: dict, expected: dict) -> dict:
    """The zoo's comparison (``hf_zoo_models.RTOL``) of jmp's loss and gradients with PyTorch's."""
    from benchmarks.hf_zoo_models import RTOL, _relative_error

    missing = sorted(set(expected) - set(actual))
    largest = max(float(abs(g).max()) for g in expected.values())
    loss_error = abs(loss - expected_loss) / max(abs(expected_loss), 1e-12)
    errors = {n: _relative_error(actual[n], g, 0.1 * largest) for n, g in expected.items() if n in actual}
    worst = max(errors, key=errors.get) if errors else None
    figures = {
        "loss": loss,
        "torch_loss": expected_loss,
        "loss_rel_error": loss_error,
        "max_grad_rel_error": errors[worst] if worst else None,
        "worst_gradient": worst,
        "gradients": len(expected),
    }
    if missing or loss_error > RTOL or (worst and errors[worst] > RTOL):
        reason = f"no JAX gradient for {missing[:3]}" if missing else "loss or a gradient differs from PyTorch's"
        return {"status": "numerics", "category": "numerics", "error": reason, **figures}
    return {"status": "pass", **figures}


def check(model_type: str, shrink_level: int, by_attributes: bool, layers: int = 0) -> dict:
    """One architecture: PyTorch's step and jmp's with ``scan_layers`` on, compared; the stacks and scans."""
    from benchmarks.hf_zoo_models import SHRINK_LEVELS

    row: dict[str, Any] = {"model_type": model_type}
    attempts = [(shrink_level, by_attributes)]
    attempts += [(level, by) for level in range(SHRINK_LEVELS) for by in (False, True) if (level, by) != attempts[0]]
    first_error = None
    for level, by in attempts:  # the zoo's shrink level first; PyTorch may fail on it with more layers
        try:
            model, inputs, expected_loss, expected, period = _torch_model(model_type, level, by, layers)
            break
        except Exception as error:  # noqa: BLE001 - PyTorch fails on every shrunk config: excluded
            first_error = first_error or error
    else:
        return {**row, "status": "torch_fails", "category": "torch_fails", "error": str(first_error)[:400]}
    row.update(shrink_level=level, shrunk_by_attributes=by, layers=_layers(model))
    lines = _StackLines()
    logger = logging.getLogger("jmp")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        distributed, loss, grads, scans = _jmp_step(model, inputs)
    except Exception as error:  # noqa: BLE001 - recorded as the architecture's failure
        return {**row, "period": period, **_failure("jax", error), "stack_log": lines.lines}
    finally:
        logger.removeHandler(lines)
    stacks = [{"container": s.container, "layers": len(s.paths)} for s in distributed.stacks]
    row.update(period=period, stacks=stacks, scan_equations=scans, stack_log=lines.lines)
    row["scanned"] = scans > 0
    if not scans:
        row["not_scanned_reason"] = _not_scanned_reason(stacks, lines.lines)
    return {**row, **_compare(loss, expected_loss, grads, expected)}


def _layers(model: Any) -> int:
    """The length of the model's longest layer list."""
    from jmp.stacks import find_stacks

    return max((len(s.paths) for s in find_stacks(model)), default=0)


def _not_scanned_reason(stacks: list[dict], lines: list[str]) -> str:
    if not stacks:
        return "no stack detected"
    for line in lines:
        if "run one by one:" in line:
            return line.split("run one by one:", 1)[1].strip()
    return "stack detected, no scan and no reason logged"


# --- the sweep ----------------------------------------------------------------------------------------------------


def run_one(model_type: str, timeout_s: int, layers: int = 0) -> dict:
    """``check`` in a fresh process with one XLA device (``layers`` layers, 0: as many as it takes to scan); its
    JSON row, or a timeout / crash row."""
    zoo = json.loads(ZOO_RESULTS.read_text())["architectures"][f"{FAMILY}/{model_type}"]
    spec = f"{model_type}/{zoo.get('shrink_level') or 0}/{int(bool(zoo.get('shrunk_by_attributes')))}/{layers}"
    command = [sys.executable, "-m", "benchmarks.hf_zoo_scan", "--worker", spec]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    }
    return hf_zoo.run_worker(command, env, {"model_type": model_type}, timeout_s, tail_lines=5)


def summarise(rows: dict[str, dict]) -> dict:
    """Passed, scanned, not scanned by reason, failed by category; excluded: PyTorch fails with these layers."""
    failed: dict[str, list[str]] = collections.defaultdict(list)
    not_scanned: dict[str, list[str]] = collections.defaultdict(list)
    excluded = {}
    for name, row in sorted(rows.items()):
        if row["status"] == "torch_fails":
            excluded[name] = row["error"][:200]
        elif row["status"] != "pass":
            failed[row["category"]].append(name)
        if "scanned" in row and not row["scanned"]:
            not_scanned[row["not_scanned_reason"]].append(name)
    return {
        "swept": len(rows),
        "torch_runs": len(rows) - len(excluded),
        "passed": sum(r["status"] == "pass" for r in rows.values()),
        "scanned": sum(bool(r.get("scanned")) for r in rows.values()),
        "scanned_and_passed": sum(bool(r.get("scanned")) and r["status"] == "pass" for r in rows.values()),
        "not_scanned_by_reason": {reason: names for reason, names in sorted(not_scanned.items())},
        "failed_by_category": {category: names for category, names in sorted(failed.items())},
        "excluded_torch_fails": excluded,
    }


def _load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"architectures": {}}


def _save(results: dict) -> None:
    results["summary"] = summarise(results["architectures"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def print_report(summary: dict) -> None:
    print(f"swept {summary['swept']}, PyTorch runs {summary['torch_runs']}: passed {summary['passed']}, ", end="")
    print(f"scanned {summary['scanned']}, excluded (PyTorch fails) {len(summary['excluded_torch_fails'])}")
    for reason, names in summary["not_scanned_by_reason"].items():
        print(f"not scanned ({len(names)}), {reason}: {', '.join(names)}")
    for category, names in summary["failed_by_category"].items():
        print(f"failed ({len(names)}), {category}: {', '.join(names)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated causal-LM model types")
    parser.add_argument("--limit", type=int, help="at most this many architectures this run")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--layers", type=int, default=0, help="layers per model (4, or 3 periods of layer kinds)")
    parser.add_argument("--rerun", action="store_true", help="run architectures already in the results again")
    parser.add_argument("--report", action="store_true", help="print the summary of the saved results and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_type, level, by_attributes, layers = [*args.worker.split("/"), "0"][:4]
        print(json.dumps(check(model_type, int(level), bool(int(by_attributes)), int(layers))), flush=True)
        return
    results = _load()
    if args.report:
        print_report(summarise(results["architectures"]))
        return
    names = args.only.split(",") if args.only else passing_architectures()
    if not args.rerun:
        names = [n for n in names if n not in results["architectures"]]
    for name in names[: args.limit] if args.limit else names:
        row = run_one(name, args.timeout, args.layers)
        results["architectures"][name] = row
        _save(results)
        scanned = row.get("scan_equations", "-")
        print(
            f"{name:32} {row['status']:12} scans={scanned} {row['seconds']}s  {row.get('error', '')[:100]}", flush=True
        )
    print_report(summarise(results["architectures"]))


if __name__ == "__main__":
    main()
