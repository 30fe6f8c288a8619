"""Image models nobody here wrote (timm, torchvision) in train mode, one ``@smp.step`` under data parallelism (dp8)
and sharded data parallelism (``{"sharded_data_parallel_degree": 8}``) on 8 emulated CPU devices, against PyTorch's
gradients on the same weights and data.

Each row is one model (``MODELS``: small timm and torchvision classifiers, 10 classes, ``BATCH`` x 3 x ``IMAGE`` x
``IMAGE``, seed 0, train mode: batch-norm on batch statistics; dropout off, since jmp draws its own masks) in one
variant (``plain``; ``channels_last``: the model and its input in torch's channels-last memory format; ``fx``: the
model traced by ``torch.fx.symbolic_trace``, a ``GraphModule``; ``jit_norm``: timm's norm-act layers
``torch.jit.script``-ed as timm does for ``jit=True``, which jmp refuses by design: ``unsupported``; ``drop_path``:
stochastic depth on, see below) and one config, in a subprocess with a time limit. The step is ``loss =
F.cross_entropy(model(x), y); model.backward(loss)``. The reference is PyTorch in float64 on the same weights (the
float32 gradients of a bias that a later normalisation cancels, or of a layer behind a batch-norm in train mode, are
ill-conditioned: float32 PyTorch itself is 1e-3 off on some of them), and PyTorch in float32 is measured against it
too. A gradient's error is its largest absolute difference over the largest magnitude of the float64 gradient,
floored at ``FLOOR`` times the model's largest gradient (a gradient that is zero in exact arithmetic is float noise
below that). A row passes when the losses agree within ``LOSS_RTOL`` and every gradient is within ``GRAD_RTOL`` or
within ``SLACK`` times float32 PyTorch's own error on it; the batch-norm running statistics after the step are
compared with PyTorch's (one forward over the whole batch: one process is one rank, so jmp's step normalises over
its whole batch across the 8 devices) in the same way. Each row records the status, the worst gradient, and per
parameter kind (the owning module's class and ``weight``/``bias``) jmp's and float32 PyTorch's largest error.

Stochastic depth: jmp draws its own masks (one keep/drop per row and per ``DropPath``), so the reference reads
them back. The step also returns the logits; for each row, PyTorch (float64) computes that row's logits under
every combination of the model's masks, and exactly one must match jmp's (within ``MASK_RTOL`` of the row's
largest logit, the next within no less than ``MASK_GAP`` times that). The reference then runs the whole batch
under those masks (each ``DropPath`` multiplying its row by 0 or 1 / keep probability, as timm's ``drop_path``
does), and the row is compared as any other. The row records how often each mask kept its path.

Its environment: PyPI's torchvision is a CUDA build whose ``_C`` extension cannot load on this CPU torch (and its
missing ops make ``transformers`` refuse to import its models), so it lives in a venv of its own that reuses the
project's venv for everything else::

    python3 -m venv /tmp/imgvenv
    echo "import site; site.addsitedir('$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')')" \\
        > "$(/tmp/imgvenv/bin/python -c 'import site; print(site.getsitepackages()[0])')/mainvenv.pth"
    /tmp/imgvenv/bin/pip install --no-deps timm "torchvision==0.28.*"   # torchvision 0.28 is torch 2.13's

This module defines the two torchvision ops (``nms``, ``qnms``) whose fake kernels torchvision registers
unconditionally at import, when torchvision's own extension did not load; nothing calls them. Then::

    /tmp/imgvenv/bin/python -m benchmarks.image_zoo                 # every row; resumable
    /tmp/imgvenv/bin/python -m benchmarks.image_zoo --only timm/mobilevitv2_050 --rerun
    /tmp/imgvenv/bin/python -m benchmarks.image_zoo --report

Results in ``benchmarks/results/image_zoo.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "image_zoo.json"
TIMEOUT_S = 420
DEVICES, BATCH, IMAGE, CLASSES = 8, 8, 64, 10
LOSS_RTOL, GRAD_RTOL, FLOOR, SLACK = 1e-5, 1e-4, 1e-3, 4.0
MASK_RTOL, MASK_GAP = 1e-4, 100.0
CONFIGS = {"dp8": {}, "sdp8": {"sharded_data_parallel_degree": 8}}

# (source, name, constructor keywords, variant)
MODELS: list[tuple[str, str, dict, str]] = [
    ("timm", "mobilevitv2_050", {}, "plain"),
    ("timm", "mobilevitv2_050", {}, "channels_last"),
    ("timm", "mobilevit_xxs", {}, "plain"),
    ("timm", "mobilenetv3_small_050", {}, "plain"),
    ("timm", "lcnet_050", {}, "jit_norm"),
    ("timm", "efficientnet_b0", {}, "plain"),
    ("timm", "resnet18", {}, "channels_last"),
    ("timm", "convnext_atto", {}, "plain"),
    ("timm", "regnetx_002", {}, "plain"),
    ("timm", "ghostnet_050", {}, "plain"),
    ("timm", "vit_tiny_patch16_224", {"img_size": IMAGE}, "plain"),
    ("timm", "levit_128s", {"img_size": IMAGE}, "plain"),
    ("torchvision", "resnet18", {}, "fx"),
    ("torchvision", "mobilenet_v3_small", {}, "plain"),
    ("torchvision", "shufflenet_v2_x0_5", {}, "plain"),
    ("torchvision", "efficientnet_b0", {"stochastic_depth_prob": 0.0}, "channels_last"),
    ("torchvision", "squeezenet1_1", {}, "plain"),
    # stochastic depth (timm's DropPath, drop_path_rate 0.5 spread over the blocks): no batch norm, so each row's
    # output depends on its own masks only, which the reference reads back from jmp's outputs (``drop_path_masks``)
    ("timm", "vit_tiny_patch16_224", {"img_size": IMAGE, "depth": 3, "drop_path_rate": 0.5}, "drop_path"),
    # ConvNeXt's layer scale starts at 1e-6, so its blocks' paths would change the logits below float32 rounding
    ("timm", "convnext_atto", {"depths": (1, 1, 1, 1), "drop_path_rate": 0.5, "ls_init_value": 1.0}, "drop_path"),
]


def row_key(source: str, name: str, variant: str, config: str) -> str:
    return f"{source}/{name}/{variant}/{config}"


# --- one row (the worker process) -------------------------------------------------------------------------------


def _define_missing_torchvision_ops() -> None:
    """torchvision registers fake kernels for ``torchvision::nms`` / ``qnms`` at import whether or not its
    extension loaded; where it cannot load (a CUDA wheel on CPU torch) the ops must exist for the import to work."""
    import ctypes
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    try:
        ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / "_C.so"))
        return
    except OSError:
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _define_missing_torchvision_ops.library = library  # kept alive: dropping it removes the definitions


def _build(source: str, name: str, kwargs: dict, variant: str):
    import torch

    torch.manual_seed(0)
    if source == "timm":
        import timm

        # drop_rate 0: some heads call F.dropout themselves (GhostNet), which no module attribute turns off
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.0, **kwargs)
    else:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=CLASSES, **kwargs)
    model.train()
    for module in model.modules():  # no dropout (the classifiers' p=0.2 or 0.5): jmp draws other masks than torch
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    if variant == "jit_norm":  # what timm's create_norm_act_layer(..., jit=True) does to each norm-act layer
        from timm.layers.norm_act import BatchNormAct2d

        for name, module in list(model.named_modules()):
            if type(module) is BatchNormAct2d:
                parent, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(parent), attribute, torch.jit.script(module))
    if variant == "fx":
        model = torch.fx.symbolic_trace(model)
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    return model


def _kinds(model) -> dict[str, str]:
    """Parameter name -> "<module class>.<weight|bias>"."""
    kinds = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            kinds[full] = f"{type(module).__name__}.{param_name}"
    return kinds


def _error(actual, expected, floor: float) -> float:
    import numpy as np

    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not expected.size:
        return 0.0
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), floor, 1e-30)


def _named(tree) -> dict:
    import jax
    import numpy as np

    return {
        ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def drop_paths(model) -> list[tuple[object, float]]:
    """(module, keep probability) of each stochastic-depth module of ``model`` that can drop its path: timm's
    ``DropPath`` and torchvision's ``StochasticDepth`` (either mode), found by class name."""
    found = []
    for module in model.modules():
        p = {"DropPath": "drop_prob", "StochasticDepth": "p"}.get(type(module).__name__)
        if p is not None and getattr(module, p) > 0:
            found.append((module, 1 - getattr(module, p)))
    return found


def with_masks(model, masks) -> None:
    """Each of ``model``'s stochastic-depth modules multiplies row i by ``masks[k][i]`` (1: kept) over its keep
    probability, as timm's ``drop_path`` and torchvision's ``stochastic_depth`` do with the masks they draw."""
    import torch

    for (module, keep), mask in zip(drop_paths(model), masks):
        rows = torch.as_tensor(mask, dtype=torch.float64)
        module.forward = lambda x, rows=rows, keep=keep: x * (rows / keep).to(x.dtype).view(-1, *[1] * (x.ndim - 1))


def drop_path_masks(model, x, logits) -> tuple[list[list[int]], float, float]:
    """The masks jmp drew, read back from its ``logits`` row by row: ([module][row] kept, worst match, nearest
    other combination)."""
    import itertools

    import numpy as np
    import torch

    reference = copy.deepcopy(model).double()
    count = len(drop_paths(reference))
    combos = list(itertools.product((0, 1), repeat=count))
    masks, worst, nearest = [[0] * len(x) for _ in range(count)], 0.0, float("inf")
    for row in range(len(x)):
        errors = []
        for combo in combos:
            with_masks(reference, [[c] for c in combo])
            with torch.no_grad():
                out = reference(x[row : row + 1].double()).numpy()[0]
            errors.append(float(np.max(np.abs(out - logits[row]))) / float(np.max(np.abs(out))))
        order = np.argsort(errors)
        worst, nearest = max(worst, errors[order[0]]), min(nearest, errors[order[1]])
        for k, kept in enumerate(combos[order[0]]):
            masks[k][row] = kept
    return masks, worst, nearest


def run_row(source: str, name: str, kwargs: dict, variant: str, config: dict) -> dict:
    """One model, one variant, one config: the comparison as a dict."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    model = _build(source, name, kwargs, variant)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    if variant == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    kinds = _kinds(model)
    initial = copy.deepcopy(model)

    def torch_step(masks=None) -> dict:
        references = {}
        for dtype in (torch.float64, torch.float32):
            reference = copy.deepcopy(initial).to(dtype)
            if masks is not None:
                with_masks(reference, masks)
            loss = F.cross_entropy(reference(x.to(dtype)), y)
            loss.backward()
            grads = {n: p.grad.double().numpy() for n, p in reference.named_parameters() if p.grad is not None}
            buffers = {
                n: b.double().numpy()
                for n, b in reference.named_buffers()
                if n.endswith(("running_mean", "running_var"))
            }
            references[dtype] = (float(loss), grads, buffers)
        return references

    import jmp as smp

    smp.init(config)
    distributed = smp.DistributedModel(model)

    @smp.step
    def train_step(model, x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        model.backward(loss)
        return logits, loss

    start = time.perf_counter()
    logits, loss = train_step(distributed, x, y)
    loss = float(loss.reduce_mean())
    seconds = time.perf_counter() - start
    drawn = {}
    if variant == "drop_path":
        masks, match, nearest = drop_path_masks(initial, x, logits.concat().detach().numpy())
        drawn = {"mask_match": match, "nearest_other_mask": nearest, "kept_per_mask": [sum(m) for m in masks]}
        drawn["distinct_rows"] = len(set(zip(*masks)))
        if match > MASK_RTOL or nearest < MASK_GAP * match:
            return {"status": "mismatch", "error": "no single mask combination gives jmp's logits", **drawn}
    references = torch_step(masks if variant == "drop_path" else None)
    loss64, g64, b64 = references[torch.float64]
    loss32, g32, b32 = references[torch.float32]
    actual = _named(distributed.grads)
    state = distributed.state_dict()
    buffers = {n: state[n].double().numpy() for n in b64 if n in state}
    largest = max(float(np.max(np.abs(g))) for g in g64.values() if g.size)
    floor = FLOOR * largest
    rows = {}
    for param, expected in g64.items():
        if param not in actual:
            return {"status": "error", "error": f"no jmp gradient for {param}"}
        rows[param] = (_error(actual[param], expected, floor), _error(g32[param], expected, floor))
    failing = {p: e for p, e in rows.items() if e[0] > max(GRAD_RTOL, SLACK * e[1])}
    by_kind: dict[str, dict] = {}
    for param, (jmp_error, torch_error) in rows.items():
        kind = by_kind.setdefault(kinds.get(param, param.rsplit(".", 1)[-1]), {"jmp": 0.0, "torch32": 0.0, "n": 0})
        kind["jmp"], kind["torch32"] = max(kind["jmp"], jmp_error), max(kind["torch32"], torch_error)
        kind["n"] += 1
    # a running mean that is zero in exact arithmetic (behind a batch-norm without activation and a bias-free
    # convolution) is float noise: floored like the gradients, at FLOOR times the largest of its kind
    stat_floor = {
        kind: FLOOR * max((float(np.max(np.abs(b))) for n, b in b64.items() if n.endswith(kind)), default=0.0)
        for kind in ("running_mean", "running_var")
    }
    buffer_errors = {
        n: (_error(buffers[n], b64[n], stat_floor[k]), _error(b32[n], b64[n], stat_floor[k]))
        for n in b64
        if n in buffers
        for k in stat_floor
        if n.endswith(k)
    }
    bad_buffers = sorted(n for n, (j, t) in buffer_errors.items() if j > max(GRAD_RTOL, SLACK * t))
    worst = max(rows, key=lambda p: rows[p][0])
    loss_error = abs(loss - loss64) / max(abs(loss64), 1e-12)
    passed = not failing and not bad_buffers and loss_error <= LOSS_RTOL
    return {
        "status": "pass" if passed else "mismatch",
        "loss": loss,
        "torch_loss": loss32,
        "loss_rel_error": loss_error,
        "torch32_loss_rel_error": abs(loss32 - loss64) / max(abs(loss64), 1e-12),
        "parameters": sum(p.numel() for p in model.parameters()),
        "gradients": len(rows),
        "worst_gradient": worst,
        "max_grad_rel_error": rows[worst][0],
        "torch32_error_there": rows[worst][1],
        "torch32_max_grad_rel_error": max(e[1] for e in rows.values()),
        "failing_gradients": {p: list(e) for p, e in sorted(failing.items(), key=lambda kv: -kv[1][0])[:10]},
        "by_kind": {k: by_kind[k] for k in sorted(by_kind)},
        "batch_norm_buffers": len(buffer_errors),
        "max_buffer_rel_error": max((j for j, _ in buffer_errors.values()), default=None),
        "failing_buffers": bad_buffers[:10],
        "step_seconds_with_compile": round(seconds, 1),
        **drawn,
    }


def _worker(key: str) -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    _define_missing_torchvision_ops()
    source, name, variant, config = key.split("/")
    kwargs = next(k for s, n, k, v in MODELS if (s, n, v) == (source, name, variant))
    try:
        result = run_row(source, name, kwargs, variant, CONFIGS[config])
    except Exception as error:  # noqa: BLE001 - recorded as the row's failure
        lines = traceback.format_exception(error)
        unsupported = "TorchScript is not supported" in str(error)  # jmp converts Python modules, by design
        message = f"{type(error).__name__}: {str(error).strip()[:400]}"
        result = {"status": "unsupported" if unsupported else "error", "error": message}
        result["traceback_tail"] = "".join(lines[-3:])[-1500:]
    print("RESULT " + json.dumps(result))


# --- the sweep --------------------------------------------------------------------------------------------------


def _run(key: str, timeout_s: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.image_zoo", "--worker", key]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": timeout_s}
    seconds = round(time.perf_counter() - start, 1)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "seconds": seconds}
    fatal = [line for line in done.stderr.splitlines() if "Check failed" in line or line.startswith("F0")]
    return {
        "status": "crash",
        "returncode": done.returncode,
        "fatal": fatal[:3],
        "stderr_tail": done.stderr[-1500:],
        "seconds": seconds,
    }


def _load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def _save(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    statuses: dict[str, int] = {}
    for key, row in results.items():
        if key != "summary":
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
    rows = {k: v for k, v in sorted(results.items()) if k != "summary"}
    summary = {"statuses": statuses, "batch": BATCH, "image": IMAGE, "devices": DEVICES, "configs": CONFIGS}
    RESULTS.write_text(json.dumps({"summary": summary, **rows}, indent=1, sort_keys=False) + "\n")


def report(results: dict) -> None:
    for key, row in results.items():
        if key == "summary":
            print(json.dumps(row))
            continue
        figures = ""
        if "max_grad_rel_error" in row:
            figures = (
                f"grad {row['max_grad_rel_error']:.1e} (torch32 {row['torch32_error_there']:.1e}) "
                f"at {row['worst_gradient']}; buffers {row['max_buffer_rel_error']}"
            )
        print(f"{key:55s} {row['status']:9s} {figures} {row.get('error', '')[:120]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated source/name[/variant[/config]] prefixes")
    parser.add_argument("--rerun", action="store_true", help="run rows already in the results again")
    parser.add_argument("--report", action="store_true", help="print the results file and exit")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    results = _load()
    if args.report:
        report(results)
        return
    prefixes = args.only.split(",") if args.only else [""]
    keys = [row_key(s, n, v, c) for s, n, _, v in MODELS for c in CONFIGS]
    for key in keys:
        if not any(key.startswith(prefix) for prefix in prefixes) or (key in results and not args.rerun):
            continue
        results[key] = _run(key, args.timeout)
        _save(results)
        row = results[key]
        print(key, row["status"], row.get("max_grad_rel_error"), row.get("worst_gradient"), row.get("error", ""))


if __name__ == "__main__":
    main()
