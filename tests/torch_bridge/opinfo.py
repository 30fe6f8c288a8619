"""Runs the bridge's lowerings on PyTorch's own OpInfo samples and compares with torch.

Used by ``test_opinfo.py``; ``python -m tests.torch_bridge.opinfo`` prints the failures.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx

import jmp.torch_bridge  # noqa: F401  (fills the registry)
from jmp.torch_bridge import dispatch, registry
from jmp.torch_bridge.interop import tensor_to_array
from jmp.torch_bridge.tensor import JaxTensor, unwrap

_RANDOM = {
    "bernoulli",
    "multinomial",
    "normal",
    "rand_like",
    "randn_like",
    "randint_like",
    "randint",
    "uniform",
    "nn.functional.dropout",
    "nn.functional.dropout2d",
    "nn.functional.dropout3d",
    "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu",
    "randn",
    "rand",
    "randperm",
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "new_empty_strided",
    "empty_permuted",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "normal_",
}


@dataclasses.dataclass
class OpReport:
    name: str
    passed: int = 0
    failed: list = dataclasses.field(default_factory=list)


def _variants(op):
    seen = []
    for fn in (op.op, op.method_variant):
        if fn is not None and registry.lookup(fn) is not None and fn not in seen:
            seen.append(fn)
    return seen


def _dtype(op):
    supported = op.supported_dtypes("cpu")
    for dtype in (torch.float32, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return None


def _to_jax(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
        return JaxTensor(tensor_to_array(value), value.dtype)
    return value


def _as_numpy(value):
    if isinstance(value, JaxTensor):
        return np.asarray(unwrap(value))
    if isinstance(value, torch.Tensor):
        return np.asarray(tensor_to_array(value))
    return np.asarray(value)


def _compare(expected, actual) -> str | None:
    expected_leaves = torch_pytree.tree_leaves(expected)
    actual_leaves = torch_pytree.tree_leaves(actual)
    if len(expected_leaves) != len(actual_leaves):
        return f"structure: {len(expected_leaves)} vs {len(actual_leaves)} leaves"
    for e, a in zip(expected_leaves, actual_leaves):
        e_np, a_np = _as_numpy(e), _as_numpy(a)
        if e_np.shape != a_np.shape:
            return f"shape {a_np.shape}, torch {e_np.shape}"
        if e_np.dtype == np.bool_ or a_np.dtype == np.bool_:
            if not np.array_equal(e_np.astype(bool), a_np.astype(bool)):
                return "boolean values differ"
            continue
        if np.iscomplexobj(e_np) != np.iscomplexobj(a_np):
            return f"dtype {a_np.dtype}, torch {e_np.dtype}"
        # Complex results compare whole (real and imaginary parts), never cast to real.
        wide = np.complex128 if np.iscomplexobj(e_np) else np.float64
        e_wide, a_wide = e_np.astype(wide), a_np.astype(wide)
        if not np.allclose(a_wide, e_wide, rtol=1e-4, atol=1e-5, equal_nan=True):
            diff = np.nanmax(np.abs(a_wide - e_wide))
            return f"values differ (max abs {diff:.3g})"
    return None


def run(limit_samples: int = 3) -> dict[str, OpReport]:
    """Every lowered op with an OpInfo entry, on its first ``limit_samples`` float32 (else int/bool) samples.

    All registered variants (function, method) run on the first sample; the
    function variant on the rest.
    """
    from torch.testing._internal.common_methods_invocations import op_db

    reports: dict[str, OpReport] = {}
    for op in op_db:
        variants = _variants(op)
        dtype = _dtype(op)
        if not variants or dtype is None:
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        report = reports.setdefault(name, OpReport(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = _first(op.sample_inputs_func(op, "cpu", dtype, False), limit_samples)
        for index, sample in enumerate(samples):
            for fn in variants if index == 0 else variants[:1]:
                outcome = _run_sample(op, fn, sample)
                if outcome is None:
                    report.passed += 1
                else:
                    report.failed.append(outcome)
    return reports


def _first(samples, count):
    out = []
    for sample in samples:
        if len(out) == count:
            break
        out.append(sample)
    return out


def _run_sample(op, fn, sample) -> str | None:
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = fn(*torch_pytree.tree_map(_clone, args), **kwargs)
    except Exception:
        return None  # torch rejects this sample on CPU; nothing to compare
    try:
        actual = _compiled(fn, args, kwargs)
    except Exception:  # noqa: BLE001  (needs concrete values, or returns Python values: run it eagerly)
        jax_args = torch_pytree.tree_map(_to_jax, args)
        jax_kwargs = torch_pytree.tree_map(_to_jax, kwargs)
        try:
            with dispatch.session(nnx.Rngs(0)):
                actual = fn(*jax_args, **jax_kwargs)
        except Exception as error:  # noqa: BLE001  (reported, not raised)
            return f"{dispatch.op_name(fn)}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if op.name in _RANDOM:
        return None
    try:
        problem = _compare(expected, actual)
    except Exception as error:  # noqa: BLE001
        problem = f"comparison failed: {type(error).__name__}: {error}"
    return None if problem is None else f"{dispatch.op_name(fn)}: {problem}"


# One small program per sample: compiling it unoptimised takes a fraction of the time XLA's full pipeline
# takes, and the numbers are the same up to the comparison's tolerance.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _compiled(fn, args, kwargs):
    """The op on the sample inside ``jax.jit`` (as jmp runs ops), its outputs as arrays."""
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    dtypes = [leaves[i].dtype for i in tensors]

    def program(arrays):
        current = list(leaves)
        for i, array, dtype in zip(tensors, arrays, dtypes):
            current[i] = JaxTensor(array, dtype)
        jax_args, jax_kwargs = torch_pytree.tree_unflatten(current, spec)
        with dispatch.session(nnx.Rngs(0)):
            out = fn(*jax_args, **jax_kwargs)
        return torch_pytree.tree_map(lambda v: unwrap(v) if isinstance(v, JaxTensor) else v, out)

    compiled = jax.jit(program, compiler_options=_FAST_COMPILE)
    return compiled([tensor_to_array(leaves[i]) for i in tensors])


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def summary(reports: dict[str, OpReport]) -> tuple[int, int, int]:
    ops = len(reports)
    passed = sum(r.passed for r in reports.values())
    total = passed + sum(len(r.failed) for r in reports.values())
    return ops, passed, total


if __name__ == "__main__":
    import sys

    results = run(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    for report in results.values():
        for failure in report.failed[:3]:
            print(f"{report.name}: {failure}")
    ops, passed, total = summary(results)
    print(f"OpInfo: {ops} ops lowered; {passed}/{total} samples match torch")
