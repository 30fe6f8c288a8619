"""The step of a model whose forward needs concrete values, run op by op instead of as one compiled program.

A forward with data-dependent shapes or branches (DeBERTa's classifier's ``nonzero``, a Python loop over the
experts some token was routed to) cannot be traced by ``jax.jit``. PyTorch trains such a model, so jmp does too:
when tracing a step raises ``TracedControlFlowError``, that step runs ``program.run`` outside ``jit`` on concrete
values (``jmp.torch_bridge.concrete_run``), its traceable module calls compiled (``jmp.compiled_step.segments``),
and a notice names the call that needed the values, where a static formulation would make it compile.
``JMP_UNCOMPILED_FALLBACK=0`` raises the tracing error instead. Pipelined models (stages are cut from the traced
program) and batches fed by several processes (the per-process step is vectorised) keep the error.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax

from jmp.compiled_step import program as step_program
from jmp.compiled_step import segments
from jmp.compiled_step.signature import StepSignature
from jmp.errors import StepError, TracedControlFlowError
from jmp.runtime import notices
from jmp.torch_bridge import concrete_run
from jmp.wrapped_model.distributed_model import DistributedModel

ENVIRONMENT = "JMP_UNCOMPILED_FALLBACK"


class UncompiledProgram:
    """``program.run`` for one signature, called outside ``jit``: the compiled program's interface."""

    def __init__(self, fn, model: DistributedModel, signature: StepSignature, traced: step_program.Traced):
        self._run = functools.partial(step_program.run, fn, model, signature, traced)
        self._name = getattr(fn, "__name__", "step")
        self._paths = [path for path, _ in model.torch_module.named_modules()]
        self.segments = segments.Segments()  # the module calls that trace run compiled

    def __call__(self, params: Any, rest: Any, arrays: list) -> Any:
        with concrete_run.running(), self.segments.installed(self._paths):
            return self._run(params, rest, arrays)

    def eval_shape(self, params: Any, rest: Any, arrays: list) -> Any:
        """The shapes of a call's results, from running it (its sizes exist only once the data is seen)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self(params, rest, arrays))

    def lower(self, *args: Any) -> Any:
        raise StepError(self._no_program())

    def trace(self, *args: Any) -> Any:
        raise StepError(self._no_program())

    def _no_program(self) -> str:
        return (
            f"step function {self._name} runs op by op (its forward needs concrete values, see the notice when it "
            "first ran), so there is no compiled program to lower or trace"
        )


def fall_back(
    fn, model: DistributedModel, signature: StepSignature, error: TracedControlFlowError
) -> tuple[UncompiledProgram, step_program.Traced]:
    """The op-by-op program for ``signature``, after tracing raised ``error``; the error itself where that cannot
    run."""
    name = getattr(fn, "__name__", "step")
    if os.environ.get(ENVIRONMENT, "1").strip().lower() in ("0", "off", "false", "no"):
        raise error
    if model.pipeline is not None or signature.process_shares > 1:
        where = "a pipelined model" if model.pipeline is not None else "a batch fed by several processes"
        raise TracedControlFlowError(
            f"{error}\nA step that needs concrete values can run op by op instead of compiled, but not for {where} "
            f"(step function {name})."
        ) from None
    first_line = str(error).splitlines()[0]
    notices.warn_once(  # once per step function and cause, not per input shape
        f"uncompiled:{name}:{first_line}",
        "step function %s runs op by op, uncompiled: its forward needs concrete values (%s). It trains as PyTorch "
        "does, without XLA's fusion (slower). A formulation with static shapes there makes it compile.",
        name,
        first_line.rstrip("."),
    )
    traced = step_program.Traced()
    return UncompiledProgram(fn, model, signature, traced), traced
