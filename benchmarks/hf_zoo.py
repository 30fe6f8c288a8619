"""The Hugging Face zoo sweep: every model class of transformers' auto mappings, shrunk, PyTorch against jmp.

For each architecture (``benchmarks/hf_zoo_models.py``: the default config made tiny, PyTorch's forward and
backward on CPU, then jmp's loss and every gradient under ``jit``), one subprocess with a time limit. The
results go to ``benchmarks/results/hf_zoo.json``: one row per architecture, the pass rate over the
architectures PyTorch runs (by family), the failures by category (``op``: a torch op without a lowering;
``construct``: conversion or tracing fails otherwise; ``numerics``: runs but differs from PyTorch;
``timeout``; ``crash``: the process died) and the exclusions (PyTorch itself fails on CPU) with PyTorch's
error. Resumable: architectures already in the file are skipped unless ``--rerun``.

    python -m benchmarks.hf_zoo --family causal_lm --limit 20
    python -m benchmarks.hf_zoo --only causal_lm/llama,masked_lm/bert --rerun
    python -m benchmarks.hf_zoo --report          # the tables of the results so far
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "hf_zoo.json"
TIMEOUT_S = 300


def _all_keys(families: list[str]) -> list[str]:
    from benchmarks.hf_zoo_models import architectures

    return [f"{family}/{model_type}" for family in families for model_type in sorted(architectures(family))]


def run_one(key: str, timeout_s: int) -> dict:
    """``check`` for one ``family/model_type`` in a fresh process; its JSON result, or a timeout / crash row."""
    family, model_type = key.split("/", 1)
    command = [sys.executable, "-m", "benchmarks.hf_zoo", "--worker", key]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    return run_worker(command, env, {"family": family, "model_type": model_type}, timeout_s)


def run_worker(command: list[str], env: dict, row: dict, timeout_s: int, tail_lines: int = 3) -> dict:
    """A worker process's JSON result (its last line starting with "{") with its seconds, or ``row`` as a timeout
    or crash (the output's last ``tail_lines`` lines)."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout", "category": "timeout", "error": f"over {timeout_s} s", "seconds": timeout_s}
    seconds = round(time.perf_counter() - started, 1)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "seconds": seconds}
    tail = (done.stderr or done.stdout).strip().splitlines()[-tail_lines:]
    return {
        **row,
        "status": "crash",
        "category": "crash",
        "error": f"exit {done.returncode}: {tail}",
        "seconds": seconds,
    }


def _missing_op(error: str) -> str:
    """The op an ``UnsupportedOpError`` names: "torch op X has no ..." or "ATen op X was called ..."."""
    if error.startswith("ATen op "):
        return error.split()[2]
    return error.split(" has no")[0].removeprefix("torch op ")


def summarise(rows: dict[str, dict]) -> dict:
    """Pass rate over what PyTorch runs, per family and in all; failures by category; exclusions."""
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    categories: dict[str, list[str]] = collections.defaultdict(list)
    missing_ops: collections.Counter = collections.Counter()
    exclusions = {}
    for key, row in sorted(rows.items()):
        counts = by_family[row["family"]]
        if row["status"] == "torch_fails":
            counts["torch_fails"] += 1
            exclusions[key] = f"{row.get('error_type', '')}: {row.get('error', '')}"[:200]
            continue
        counts["torch_runs"] += 1
        if row["status"] == "pass":
            counts["pass"] += 1
        else:
            categories[row["category"]].append(key)
            if row["category"] == "op":
                missing_ops[_missing_op(row["error"])] += 1
    families = {}
    for family, counts in sorted(by_family.items()):
        runs = counts["torch_runs"]
        rate = round(counts["pass"] / runs, 3) if runs else None
        families[family] = {**counts, "pass_rate": rate}
    runs = sum(c["torch_runs"] for c in by_family.values())
    passed = sum(c["pass"] for c in by_family.values())
    return {
        "swept": len(rows),
        "torch_runs": runs,
        "passed": passed,
        "pass_rate": round(passed / runs, 3) if runs else None,
        "by_family": families,
        "failures_by_category": {c: sorted(keys) for c, keys in sorted(categories.items())},
        "missing_ops": dict(missing_ops.most_common()),
        "exclusions": exclusions,
    }


def load_results(path: Path) -> dict:
    """A sweep's results file (rows by architecture), or an empty one."""
    return json.loads(path.read_text()) if path.exists() else {"architectures": {}}


def save_results(path: Path, results: dict, summarise_rows) -> None:
    """A sweep's results with the versions that ran and ``summarise_rows(rows)`` as their summary."""
    import jax
    import torch
    import transformers

    results["versions"] = {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    results["summary"] = summarise_rows(results["architectures"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def _load() -> dict:
    return load_results(RESULTS)


def _save(results: dict) -> None:
    save_results(RESULTS, results, summarise)


def print_report(summary: dict) -> None:
    print(f"pass rate: {summary['passed']} / {summary['torch_runs']} PyTorch runs = {summary['pass_rate']}")
    print(f"{'family':26} {'runs':>5} {'pass':>5} {'rate':>6} {'excluded':>9}")
    for family, c in summary["by_family"].items():
        counts = [c.get(k, 0) for k in ("torch_runs", "pass")] + [c["pass_rate"] or 0, c.get("torch_fails", 0)]
        print(f"{family:26} {counts[0]:5} {counts[1]:5} {counts[2]:6.2f} {counts[3]:9}")
    for category, keys in summary["failures_by_category"].items():
        print(f"{category} ({len(keys)}): {', '.join(keys)}")
    print("missing ops:", summary["missing_ops"])


def main(argv: list[str] | None = None) -> None:
    from benchmarks.hf_zoo_models import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="families to sweep (all)")
    parser.add_argument("--only", help="comma-separated family/model_type keys")
    parser.add_argument("--limit", type=int, help="at most this many architectures this run")
    parser.add_argument("--jobs", type=int, default=1, help="models at once (1: the machine's cores are shared)")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--rerun", action="store_true", help="run architectures already in the results again")
    parser.add_argument("--retry", action="append", default=[], help="run rows with this status again (torch_fails)")
    parser.add_argument("--report", action="store_true", help="print the tables of the saved results and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from benchmarks.hf_zoo_models import check

        print(json.dumps(check(*args.worker.split("/", 1))), flush=True)
        return
    results = _load()
    if args.report:
        print_report(summarise(results["architectures"]))
        return
    keys = args.only.split(",") if args.only else _all_keys(args.family or list(FAMILIES))
    if not args.rerun:
        done = results["architectures"]
        keys = [k for k in keys if k not in done or done[k]["status"] in args.retry]
    keys = keys[: args.limit] if args.limit else keys

    def run(key: str) -> tuple[str, dict]:
        return key, run_one(key, args.timeout)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for key, row in pool.map(run, keys):
            results["architectures"][key] = row
            _save(results)
            print(f"{key:50} {row['status']:12} {row.get('seconds', '')}s  {row.get('error', '')[:100]}", flush=True)
    print_report(results["summary"] if "summary" in results else summarise(results["architectures"]))


if __name__ == "__main__":
    main()
