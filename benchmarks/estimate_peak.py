"""``smp.estimate_memory`` on the local backend against the process's resident peak of a real training step.

    python -m benchmarks.estimate_peak [--cases gpt2-fsdp8-f32 ...] [--steps 21] [--out FILE.json]

On XLA:CPU the 8 emulated devices' memory is the host's, so the estimate x 8 devices must bound what the process
holds. Each case runs in a fresh process (``--worker``): ``smp.init(config)``, the baseline (Python, torch, jax,
transformers loaded, the mesh made, no model), the model built as a user would (on the meta device with delayed
initialisation, unless the case says ``eager``), ``smp.estimate_memory(module, None, batch=...)``, then
``smp.DistributedModel``, ``smp.DistributedOptimizer(torch.optim.AdamW)`` and ``--steps`` steps of ``@smp.step`` +
``optimizer.step()`` + ``zero_grad()``. The first step compiles; during the others (step program and update
measured apart) a thread reads every 1 ms the anonymous resident size (``/proc/self/statm``: resident less
file-backed, which leaves out the libraries' code pages the kernel can drop), with ``--malloc`` the bytes malloc has
handed out (glibc's ``mallinfo2``); the kernel's high-water mark of all resident pages (``VmHWM``, reset through
``/proc/self/clear_refs``) is kept too.

Compared: ``measured`` = the highest anonymous resident size in steps 2 on (malloc's heaps settle over the first few;
without ``host_memory.give_back_between_steps`` the peak still rose at step 30)
less the one just after the module was built (the estimate bounds what training adds to the process as it stands when
``smp.estimate_memory`` is called: the module, its values and its imports are the user's), against ``estimate.total x
devices``; ``ratio`` = estimate / measured (the promise: at least 1, at most 1.1). With ``--malloc``,
``measured_malloc``: the same for malloc'd bytes (buffers and host objects, without what the allocator keeps freed)
from the baseline, ``measured_malloc_from_built`` from the build, and ``ratio_live`` the estimate against it (the
resident peak less malloc's free pages); ``ratio_before``: the estimate without the terms issue 68 added
(``NEW_TERMS``); ``ratio_from_imports``: against the peak less the baseline before the module was built.

A worker that gives no row (XLA:CPU aborts a step whose collectives hang: gpt2-tp2xfsdp4-f32 in most runs) is run
again, up to ``--attempts`` runs; the row says how many aborted (``aborted_runs``) and how the last one ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

MODELS = {
    "gpt2": dict(kind="GPT2Config", vocab_size=50304, n_embd=512, n_layer=4, n_head=8, n_positions=128,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(kind="LlamaConfig", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128),
    "qwen2-8l": dict(kind="Qwen2Config", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=128),
    "qwen2-24l": dict(kind="Qwen2Config", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=128),
}  # fmt: skip
LAYOUTS = {
    "fsdp8": {"sharded_data_parallel_degree": 8},
    "tp2xfsdp4": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4},
    "pp2xdp4": {"pipeline_parallel_degree": 2, "microbatches": 2},
}
DTYPES = {"f32": {}, "bf16": {"bf16": True}}
BATCH, LENGTH = 8, 128
STEPS = 21
PAGE = os.sysconf("SC_PAGE_SIZE")
# what issue 68 added to the estimate: ``before`` is the total without them
NEW_TERMS = ("library_scratch", "programs", "in_flight", "heap_retention")


def case_names() -> list[str]:
    return [f"{m}-{lay}-{d}" for m in ("gpt2", "llama") for lay in LAYOUTS for d in DTYPES] + ["gpt2-fsdp8-f32-eager"]


def parse_case(name: str) -> tuple[dict, dict, bool]:
    """(model, config, eager) of a case: ``MODEL-LAYOUT-DTYPE``, then ``-eager`` (built with values) or ``-ckpt``
    (each decoder layer checkpointed, ``config["checkpointed"]``)."""
    parts = name.split("-")
    eager = parts[-1] == "eager"
    checkpointed = {"checkpointed": "model.layers"} if parts[-1] == "ckpt" else {}
    parts = parts[:-1] if eager or checkpointed else parts
    model, layout, dtype = "-".join(parts[:-2]), parts[-2], parts[-1]
    return MODELS[model], {**LAYOUTS[layout], **DTYPES[dtype], **checkpointed}, eager


def resident() -> tuple[int, int]:
    """(all, anonymous) resident bytes: anonymous leaves out file-backed pages (the libraries' code, which the
    kernel drops and reads again under pressure)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * PAGE, (int(fields[1]) - int(fields[2])) * PAGE


def device_bytes(jax) -> int:
    """Bytes the devices' live arrays hold (each shard once; no shard views made)."""
    total = 0
    for array in jax.live_arrays():
        if not array.is_deleted():
            shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
            total += shard * len(array.addressable_shards)
    return total


def high_water() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def allocated() -> int:
    """Bytes malloc has handed out and not had back (``jmp.runtime.host_memory.allocated_bytes``)."""
    from jmp.runtime import host_memory

    return host_memory.allocated_bytes()


class Sampler(threading.Thread):
    """The highest anonymous resident size seen, read every ``period`` seconds while ``on``; with ``malloc``, the
    highest malloc'd bytes too (``--malloc``: ``mallinfo2`` locks each of malloc's arenas while it walks their free
    lists, and read every millisecond, or every 20, it starved XLA's threads until a collective timed out: a Llama
    fsdp8 step aborted in 4 runs of 7, and in none of 4 without it)."""

    def __init__(self, malloc: bool, period: float = 0.001):
        super().__init__(daemon=True)
        self.malloc, self.period, self.peak, self.malloc_peak, self.on, self.done = malloc, period, 0, 0, False, False
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.done:
            with self.lock:
                if self.on:
                    self.peak = max(self.peak, resident()[1])
                    if self.malloc:
                        self.malloc_peak = max(self.malloc_peak, allocated())
            time.sleep(self.period)

    def phase(self) -> None:
        """Start a phase: the peaks from now on."""
        with self.lock:
            self.peak, self.malloc_peak, self.on = resident()[1], allocated(), True
            reset_high_water()


def worker(name: str, malloc: bool = False, steps: int = STEPS, keep: bool = False) -> dict:
    spec, config, eager = parse_case(name)
    checkpointed = config.pop("checkpointed", None)
    import jax
    import torch
    import transformers

    import jmp as smp
    from jmp.runtime import host_memory

    if keep:  # malloc's free pages stay between steps, as before give_back_between_steps
        host_memory.GIVE_BACK_ABOVE = sys.maxsize

    @smp.step
    def lm_step(model, batch):
        loss = model(**batch)["loss"]
        model.backward(loss)
        return loss

    def build(meta: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        hf = getattr(transformers, spec["kind"])(**{k: v for k, v in spec.items() if k != "kind"})
        with smp.delay_param_initialization(meta):
            return transformers.AutoModelForCausalLM.from_config(hf).train()

    ids = torch.randint(0, spec["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    smp.init(config)
    devices = jax.device_count()
    baseline, baseline_malloc = resident(), allocated()
    module = build(meta=not eager)  # a module built with values keeps them: part of the process before the estimate
    built, built_malloc = resident(), allocated()
    marks = {checkpointed: "each"} if checkpointed else None
    estimate = smp.estimate_memory(module, None, batch=batch, activation_checkpointing=marks)
    after_estimate = resident()

    model = smp.DistributedModel(module)
    if checkpointed:  # the user's own submodule, now part of the wrapped model
        smp.set_activation_checkpointing(module.get_submodule(checkpointed), strategy="each")
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    sampler = Sampler(malloc)
    sampler.start()
    phases: dict[str, list[int]] = {k: [] for k in ("step", "update", "step_total", "update_total", "step_malloc",
                                                     "update_malloc")}  # fmt: skip
    before_step, seconds = {}, []
    for i in range(steps):
        started = time.perf_counter()
        measuring = i > 0
        if measuring:
            before_step = {
                "resident": resident(),
                "malloc": allocated(),
                "device_arrays": device_bytes(jax),
            }
            sampler.phase()
        loss = lm_step(model, batch)
        jax.block_until_ready(model.training_state.params)
        float(loss.reduce_mean())
        if measuring:
            phases["step"].append(sampler.peak)
            phases["step_total"].append(high_water())
            phases["step_malloc"].append(sampler.malloc_peak)
            sampler.phase()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready((model.training_state.params, optimizer.opt_state))
        if measuring:
            phases["update"].append(sampler.peak)
            phases["update_total"].append(high_water())
            phases["update_malloc"].append(sampler.malloc_peak)
            seconds.append(time.perf_counter() - started)
    sampler.on, sampler.done = False, True
    peak = max(phases["step"] + phases["update"])
    live = max(phases["step_malloc"] + phases["update_malloc"]) - built_malloc if malloc else None
    measured = peak - built[1]
    total = estimate.total * devices
    before = (estimate.total - sum(getattr(estimate, t) or 0 for t in NEW_TERMS)) * devices
    result = {
        "case": name,
        "config": config,
        "delayed_init": not eager,
        "checkpointed": checkpointed,
        "parameters": sum(p.numel() for p in build(meta=True).parameters()),
        "devices": devices,
        "steps": steps,
        "kept_between_steps": keep,
        "step_seconds_median": sorted(seconds)[len(seconds) // 2] if seconds else None,
        "estimate": {k: v for k, v in estimate.as_dict().items() if k != "layout"},
        "estimate_x_devices": total,
        "before_x_devices": before,
        "baseline_resident_all_anon": baseline,
        "resident_after_estimate_all_anon": after_estimate,
        "resident_built_all_anon": built,
        "before_last_step": before_step,
        "baseline_malloc": baseline_malloc,
        "peak_anon_by_phase": {k: phases[k] for k in ("step", "update")},
        "peak_all_by_phase": {k: phases[k + "_total"] for k in ("step", "update")},
        "peak_anon": peak,
        "measured": measured,
        "ratio": total / measured,
        "ratio_before": before / measured,
        "measured_from_imports": peak - baseline[1],
        "ratio_from_imports": total / (peak - baseline[1]),
    }
    if malloc:
        result.update(
            peak_malloc_by_phase={k: phases[k + "_malloc"] for k in ("step", "update")},
            measured_malloc=max(phases["step_malloc"] + phases["update_malloc"]) - baseline_malloc,
            measured_malloc_from_built=live,
            ratio_live=total / live,
            # the devices' share of the peak: malloc'd bytes at the peak less the host's (all malloc'd bytes before
            # the last step that are not the devices' arrays)
            measured_devices=max(phases["step_malloc"][-1:] + phases["update_malloc"][-1:])
            - (before_step["malloc"] - before_step["device_arrays"]),
        )
    return result


def plan(name: str) -> dict:
    """Nothing run: the estimate of case ``name`` against this host's memory, and what ``smp.what_fits`` offers
    in it with each decoder layer checkpointed (the Qwen2 of 494M parameters was killed at 24 GiB)."""
    spec, config, _ = parse_case(name)
    import jax
    import torch
    import transformers

    import jmp as smp

    hf = getattr(transformers, spec["kind"])(**{k: v for k, v in spec.items() if k != "kind"})
    with smp.delay_param_initialization(True):
        module = transformers.AutoModelForCausalLM.from_config(hf)
    ids = torch.randint(0, spec["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    smp.init(config)
    host = os.sysconf("SC_PHYS_PAGES") * PAGE
    budget = (host - resident()[1]) // jax.device_count()  # each device's share of what the process may still take
    estimate = smp.estimate_memory(module, None, batch=batch)
    precision = {k: v for k, v in config.items() if k == "bf16"}
    layouts = [LAYOUTS[layout] for layout in ("fsdp8", "tp2xfsdp4")]
    checkpointed = {"model.layers": "each"}
    fitting = smp.what_fits(
        module, budget, batch, layouts=layouts, activation_checkpointing=checkpointed, config=precision
    )
    return {
        "case": name,
        "host_bytes": host,
        "budget_per_device": budget,
        "estimate": estimate.as_dict(),
        "fits": estimate.fits(budget),
        "what_fits_checkpointed": [{"config": c, "estimate": e.as_dict()} for c, e in fitting],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=case_names())
    parser.add_argument("--out", default="benchmarks/results/estimate_peak.json")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps run, the first (compiling) not measured")
    parser.add_argument("--keep-between-steps", action="store_true", help="as before: no malloc_trim after updates")
    parser.add_argument("--attempts", type=int, default=3, help="runs of a case until one finishes and gives a row")
    parser.add_argument("--worker")
    parser.add_argument("--malloc", action="store_true", help="also sample malloc's bytes (can stall XLA: Sampler)")
    parser.add_argument("--plan", help="a case to estimate against this host's memory, without running it")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.malloc, args.steps, args.keep_between_steps)), flush=True)
        return
    if args.plan:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        result = plan(args.plan)
        print(json.dumps(result, indent=1), flush=True)
        saved = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
        saved.setdefault("plans", {})[args.plan] = result
        json.dump(saved, open(args.out, "w"), indent=2, default=str)
        return
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    rows, previous = [], {}
    if os.path.exists(args.out):
        saved = json.load(open(args.out))
        previous = {row["case"]: row for row in saved.get("rows", [])}
    for name in args.cases:
        command = [sys.executable, "-m", "benchmarks.estimate_peak", "--worker", name, "--steps", str(args.steps)]
        command += ["--malloc"] * args.malloc + ["--keep-between-steps"] * args.keep_between_steps
        aborted = []  # the ends of the stderr of runs that gave no row (XLA:CPU aborts a hung collective)
        for _ in range(args.attempts):
            run = subprocess.run(command, env=env, capture_output=True, text=True)
            found = [line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            if found:
                break
            aborted.append(run.stderr[-2000:])
        row = json.loads(found[0]) if found else {"case": name, "error": aborted[-1]}
        if found and aborted:  # measured on a run that finished; the others are part of the result
            row.update(aborted_runs=len(aborted), abort=aborted[-1][-600:])
        rows.append(row)
        if "ratio" in row:
            gib = 2**30
            live = f"; to malloc'd bytes {row['ratio_live']:.3f}" if "ratio_live" in row else ""
            print(f"{name:28s} estimate {row['estimate_x_devices'] / gib:6.3f} GiB  measured "
                  f"{row['measured'] / gib:6.3f} GiB  ratio {row['ratio']:.3f} "
                  f"(before {row['ratio_before']:.3f}{live})",
                  flush=True)  # fmt: skip
        else:
            print(f"{name}: failed\n{row['error']}", flush=True)
        previous[name] = row
    from benchmarks.harness import machine, write_results

    plans = json.load(open(args.out)).get("plans", {}) if os.path.exists(args.out) else {}
    write_results(args.out, {"machine": machine(), "rows": list(previous.values()), "plans": plans})


if __name__ == "__main__":
    main()
