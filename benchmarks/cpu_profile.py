"""Where a GPT-2 training step's CPU time goes: jmp, the same model hand-written in JAX, and PyTorch.

    python -m benchmarks.cpu_profile [--steps 5] [--out benchmarks/results/cpu_profile.json]

The GPT-2 and step of ``benchmarks.step_speed`` (4 layers, d_model 256, batch 8 x 128, AdamW, float32, one CPU
device): jmp's ``@smp.step`` with its update, the hand-written ``jax.jit`` step, and PyTorch eager, each profiled
over ``--steps`` steps after warm-up. XLA:CPU reports each thunk it runs when ``--xla_cpu_enable_xprof_traceme``
is set (this module sets it before JAX starts); the thunks are summed per step by kind, and each YNNPACK fusion
is told apart by what its fused computation holds in the compiled HLO (a ``dot``, else a ``reduce``, else
elementwise). Times are CPU time summed over XLA's threads, so a kind's share of its side's total is the figure to
compare; PyTorch's are ``torch.profiler``'s self CPU time per op. The step wall times are not the benchmark
(``step_speed`` measures those without a profiler).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
os.environ.setdefault("JMP_COMPILATION_CACHE", "off")

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks import step_speed  # noqa: E402
from benchmarks.harness import lm_step, machine, token_ids, write_results  # noqa: E402

_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "$", "Pjit", "PjRt", "TfrtCpu")


def fusion_contents(hlo: str) -> dict[str, str]:
    """Fusion instruction name -> "dot", "reduce" or "elementwise": what its called computation holds."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            current = bodies.setdefault(line.split()[0].lstrip("%"), [])
        elif line == "}":
            current = None
        elif current is not None:
            current.append(line)
    kinds = {}
    for line in hlo.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\bfusion\(.*?calls=%?([\w.\-]+)", line)
        if found:
            body = "\n".join(bodies.get(found.group(2), []))
            kinds[found.group(1)] = "dot" if " dot(" in body else "reduce" if " reduce(" in body else "elementwise"
    return kinds


def thunk_kind(name: str, contents: dict[str, str]) -> str | None:
    """The kind a thunk's time is summed under; None for the executor's own wrappers."""
    if name.startswith(_WRAPPERS):
        return None
    if name.startswith("ynn_fusion"):
        return f"YNNPACK fusion: {contents.get(name, 'unknown')}"
    base = re.sub(r"\.\d+$", "", name)
    if base == "dot" or base.startswith("dot_"):
        return "dot (Eigen)"
    if "fusion" in base:
        return f"XLA fusion: {contents.get(name, 'elementwise')}"
    return base


def profile_jax(run, hlo: str, steps: int) -> dict:
    """CPU milliseconds per step by thunk kind for ``run`` (a callable doing one step)."""
    contents = fusion_contents(hlo)
    for _ in range(2):
        jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(steps):
                jax.block_until_ready(run())
        data = ProfileData.from_file(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0])
        totals: collections.Counter = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if "XLAEigen" not in line.name:  # XLA:CPU's worker threads run the thunks
                    continue
                for event in line.events:
                    kind = thunk_kind(event.name, contents)
                    if kind:
                        totals[kind] += event.duration_ns / 1e6 / steps
    return by_share(totals)


def profile_torch(iteration, steps: int) -> dict:
    for _ in range(2):
        iteration()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            iteration()
    totals: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "Optimizer")) or "Backward" in event.key:
            totals[event.key] += event.self_cpu_time_total / 1e3 / steps
    return by_share(totals)


def by_share(totals: collections.Counter) -> dict:
    whole = sum(totals.values())
    top = totals.most_common(14)
    return {
        "cpu_ms_per_step": whole,
        "kinds": {k: {"ms": v, "share": v / whole} for k, v in top},
        "other_ms": whole - sum(v for _, v in top),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cpu_profile.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    ids = token_ids(step_speed.GPT2_BATCH, step_speed.GPT2_SEQUENCE, step_speed.GPT2["vocab"])

    smp.init({"microbatches": 1}, devices=jax.devices()[:1])
    model = smp.DistributedModel(step_speed.gpt2_model())
    optimizer = smp.DistributedOptimizer(step_speed.gpt2_optimizer(model.module.parameters()))

    def jmp_iteration():
        optimizer.zero_grad()
        loss = lm_step(model, ids).reduce_mean()  # lm_step is an @smp.step
        optimizer.step()
        return loss, model.training_state.params

    jmp_hlo = lm_step.lower(model, ids).compile().as_text()  # the update's fusions are not in it: "unknown"
    handwritten_step, state, tokens = step_speed.handwritten_jax_step(ids)
    handwritten_hlo = handwritten_step.lower(*state, tokens).compile().as_text()

    def handwritten():
        state[0], state[1], loss = handwritten_step(state[0], state[1], tokens)
        return loss

    torch_iteration, _ = step_speed.torch_run(
        step_speed.gpt2_model, step_speed.gpt2_optimizer, step_speed.gpt2_loss(ids)
    )
    result = {
        "machine": machine(),
        "what": __doc__.splitlines()[0],
        "jmp": profile_jax(jmp_iteration, jmp_hlo, args.steps),
        "handwritten_jax": profile_jax(handwritten, handwritten_hlo, args.steps),
        "torch_eager": profile_torch(torch_iteration, args.steps),
    }
    write_results(args.out, result)
    for side in ("jmp", "handwritten_jax", "torch_eager"):
        print(f"{side}: {result[side]['cpu_ms_per_step']:.1f} CPU ms a step")
        for kind, figure in result[side]["kinds"].items():
            print(f"  {figure['ms']:8.2f} ms {figure['share']:6.1%}  {kind}")


if __name__ == "__main__":
    main()
