"""Runs the bridge's lowerings on PyTorch's own OpInfo samples and compares with torch.

Used by ``test_opinfo.py``; ``python -m tests.torch_bridge.opinfo`` prints the failures.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx

import jmp.torch_bridge  # noqa: F401  (fills the registry)
from jmp.torch_bridge import dispatch, padded_nonzero, registry
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
    cases: list[_Case] = []
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
                case = _Case(op, fn, sample, report)
                if case.runs_in_torch():
                    cases.append(case)
                else:
                    report.passed += 1  # torch rejects this sample on CPU; nothing to compare
    for start in range(0, len(cases), _CASES_PER_PROGRAM):
        _run_compiled(cases[start : start + _CASES_PER_PROGRAM])
    for case in cases:
        outcome = case.outcome()
        if outcome is None:
            case.report.passed += 1
        else:
            case.report.failed.append(outcome)
    return reports


def _first(samples, count):
    out = []
    for sample in samples:
        if len(out) == count:
            break
        out.append(sample)
    return out


@dataclasses.dataclass
class _Case:
    """One op variant on one sample: torch's result, then jmp's (compiled, else eager)."""

    op: Any
    fn: Callable
    sample: Any
    report: OpReport
    expected: Any = None
    actual: Any = None
    error: str | None = None  # what jmp's lowering raised when run eagerly

    @property
    def args(self) -> tuple:
        return (self.sample.input, *self.sample.args)

    def runs_in_torch(self) -> bool:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.expected = self.fn(*torch_pytree.tree_map(_clone, self.args), **self.sample.kwargs)
        except Exception:
            return False
        return True

    def tensor_leaves(self) -> tuple[list, list[int], Any]:
        leaves, spec = torch_pytree.tree_flatten((self.args, dict(self.sample.kwargs)))
        return leaves, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)], spec

    def traced(self, arrays: list) -> Any:
        """The op on the sample with its tensors replaced by ``arrays`` (inside ``jax.jit``), its outputs as arrays."""
        leaves, tensors, spec = self.tensor_leaves()
        current = list(leaves)
        for i, array in zip(tensors, arrays):
            current[i] = JaxTensor(array, leaves[i].dtype)
        jax_args, jax_kwargs = torch_pytree.tree_unflatten(current, spec)
        with dispatch.session(nnx.Rngs(0)):  # a padded nonzero is refused here as in a model's output: eagerly
            out = padded_nonzero.refuse(self.fn(*jax_args, **jax_kwargs), "the op's output")
        out = torch_pytree.tree_map(lambda v: unwrap(v) if isinstance(v, JaxTensor) else v, out)
        if not all(isinstance(leaf, _JAX_VALUES) for leaf in jax.tree.leaves(out)):
            raise TypeError(f"{dispatch.op_name(self.fn)} returns values jax.jit does not return")
        return out

    def run_eagerly(self) -> None:
        """The op outside jit: it needs concrete values, or returns Python values."""
        jax_args = torch_pytree.tree_map(_to_jax, self.args)
        jax_kwargs = torch_pytree.tree_map(_to_jax, dict(self.sample.kwargs))
        try:
            with dispatch.session(nnx.Rngs(0)):
                self.actual = self.fn(*jax_args, **jax_kwargs)
        except Exception as error:  # noqa: BLE001  (reported, not raised)
            self.error = f"{dispatch.op_name(self.fn)}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"

    def outcome(self) -> str | None:
        if self.error is not None:
            return self.error
        if self.op.name in _RANDOM:
            return None
        try:
            problem = _compare(self.expected, self.actual)
        except Exception as error:  # noqa: BLE001
            problem = f"comparison failed: {type(error).__name__}: {error}"
        return None if problem is None else f"{dispatch.op_name(self.fn)}: {problem}"


# The samples run inside jax.jit, as jmp runs ops: a few hundred side by side in one program, each on its own
# inputs, since XLA:CPU's fixed cost per program (~40 ms) is most of what a program of one op costs. An op that
# cannot be traced runs eagerly, as it would alone. Unoptimised compilation: the numbers are the same up to the
# comparison's tolerance.
_CASES_PER_PROGRAM = 200
_FAST_COMPILE = {"xla_backend_optimization_level": 0}
_JAX_VALUES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)  # what a jitted function may return


def _run_compiled(cases: list[_Case]) -> None:
    """Each case's ``actual`` from one program computing them all, or eagerly where the op could not be traced.
    A program that fails as a whole (XLA refused it) runs again, one case per program."""
    traced = [False] * len(cases)

    def program(arrays_per_case):
        outputs = []
        for index, (case, arrays) in enumerate(zip(cases, arrays_per_case)):
            try:
                outputs.append(case.traced(arrays))
                traced[index] = True
            except Exception:  # noqa: BLE001  (runs eagerly below)
                outputs.append(None)
        return outputs

    arrays = []
    for case in cases:
        leaves, tensors, _ = case.tensor_leaves()
        arrays.append([tensor_to_array(leaves[i]) for i in tensors])
    try:
        outputs = jax.jit(program, compiler_options=_FAST_COMPILE)(arrays)
    except Exception:  # noqa: BLE001
        if len(cases) == 1:
            cases[0].run_eagerly()
        else:
            for case in cases:
                _run_compiled([case])
        return
    for case, out, ran in zip(cases, outputs, traced):
        if ran:
            case.actual = out
        else:
            case.run_eagerly()


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
