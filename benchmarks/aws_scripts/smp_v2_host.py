"""Run AWS's SMP v2 ``train.py`` as SageMaker would, on a host without CUDA: ``smp_v2_host.py SCRIPT [args...]``, SCRIPT
the ``train.py`` of a checkout's ``shared-scripts/`` (``checkout.py``).

``python -m jmp.launch`` provides what jmp stands for (``torch.sagemaker``, PyTorch's FSDP wrapper names, the
``smddp`` backend). What this adds around the unmodified script is what a CPU host lacks and jmp has no business
providing; each piece acts only when the real thing is missing, and says so once on stderr (rank 0) when it acts:

- CUDA calls, on a torch without CUDA: ``torch.cuda.device_count()`` is 1 (the script computes
  ``rank % device_count()``: one device per process, as the launcher runs it; a CPU build returns 0, a
  ``ZeroDivisionError``), ``set_device`` does nothing, ``current_device()`` is 0 (the FSDP ``device_id``, which
  jmp does not use: JAX places the arrays), ``synchronize`` does nothing (nothing to wait for: a step's results
  are read with ``loss.item()``), ``nvtx.range_push`` / ``range_pop`` do nothing (profiler ranges). A CPU build
  raises on each. ``empty_cache`` is already a no-op on a CPU build and is left alone.
- ``transformer_engine``, imported at the top of ``train_lib.py`` in every configuration, when it is not
  installed: ``DelayedScaling`` and ``Format`` are TE's recipe as data, ``fp8_autocast(enabled=True, fp8_recipe=...)``
  is jmp's (``jmp.precision.fp8_autocast``: the model called inside trains its ``nn.Linear`` matmuls in fp8 with
  TE's delayed scaling), ``fp8_autocast(enabled=False)`` a no-op context; ``checkpoint`` raises (jmp's
  ``checkpoint_wrapper`` takes it as ``checkpoint_fn`` and never calls it).
- ``datasets``, imported by ``data/pipelines/__init__.py`` in every configuration for the ``--dataset_type hf``
  path (``load_from_disk``), when it is not installed: a stand-in whose ``load_from_disk`` raises. The package
  (pyarrow and pandas with it) is not installed for the ``gpt_jsonl`` path, which never calls it.
- ``AutoModelForCausalLM.from_config`` / ``from_pretrained`` with ``attn_implementation="flash_attention_2"``
  (what the script asks of transformers >= 4.37.1) without the ``flash_attn`` package: ``"sdpa"`` instead,
  ``F.scaled_dot_product_attention``, which jmp lowers to ``jax.nn.dot_product_attention``.

Then the script runs as ``__main__`` with its own folder first on ``sys.path``, as ``python SCRIPT`` would; an
error it raises is printed here too (see ``main``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import traceback
import types

HARNESS_NOTE = "smp_v2_host:"
_noted: set[str] = set()


def _note(message: str) -> None:
    if message in _noted:
        return
    _noted.add(message)
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"{HARNESS_NOTE} {message}\n")  # one write: other processes' lines go between lines only
        sys.stderr.flush()


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# --- CUDA calls -----------------------------------------------------------------------------------------------


def _acting(name: str, why: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _note(f"torch.cuda.{name}: {why} (torch has no CUDA here)")
        return fn(*args, **kwargs)

    return call


def cuda_calls_for_a_cpu_host() -> list[str]:
    """On a torch without CUDA, the CUDA calls the script makes in every configuration; returns their names."""
    import torch

    if torch.cuda.is_available():
        return []
    cuda = torch.cuda
    replaced = {
        "device_count": ("returns 1, one device per process", lambda: 1),
        "set_device": ("does nothing: JAX places jmp's arrays", lambda device: None),
        "current_device": ("returns 0 (FSDP's device_id, unused by jmp)", lambda: 0),
        "synchronize": ("does nothing: nothing runs asynchronously on torch's side", lambda device=None: None),
    }
    for name, (why, fn) in replaced.items():
        setattr(cuda, name, _acting(name, why, fn))
    cuda.nvtx.range_push = _acting("nvtx.range_push", "does nothing (profiler range)", lambda msg: 0)
    cuda.nvtx.range_pop = _acting("nvtx.range_pop", "does nothing (profiler range)", lambda: 0)
    return [*replaced, "nvtx.range_push", "nvtx.range_pop"]


# --- stand-ins for packages a CPU host lacks --------------------------------------------------------------------


def _transformer_engine() -> dict[str, types.ModuleType]:
    """``transformer_engine``: its fp8 recipe and region as jmp's (``jmp.precision.fp8_autocast``)."""

    class Format(enum.Enum):
        E4M3 = "E4M3"
        E5M2 = "E5M2"
        HYBRID = "HYBRID"

    def DelayedScaling(  # noqa: N802 (the recipe class's name)
        margin=0, interval=1, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max", **kwargs
    ):
        return types.SimpleNamespace(
            margin=margin, fp8_format=fp8_format, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo
        )

    def fp8_autocast(enabled: bool = True, fp8_recipe=None, **kwargs):
        if not enabled:
            return contextlib.nullcontext()
        from jmp.precision.fp8_autocast import fp8_autocast as jmp_fp8_autocast

        _note("transformer_engine.pytorch.fp8_autocast: jmp's fp8 (nn.Linear matmuls in fp8, TE's delayed scaling)")
        return jmp_fp8_autocast(enabled=True, fp8_recipe=fp8_recipe, **kwargs)

    def checkpoint(*args, **kwargs):
        raise NotImplementedError(
            "transformer_engine.pytorch.checkpoint is not called under jmp: checkpoint_wrapper recomputes with "
            "jax.checkpoint"
        )

    root = types.ModuleType("transformer_engine")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    pytorch.fp8_autocast, pytorch.checkpoint = fp8_autocast, checkpoint
    root.common, common.recipe, root.pytorch = common, recipe, pytorch
    return {m.__name__: m for m in (root, common, recipe, pytorch)}


def _datasets() -> dict[str, types.ModuleType]:
    """``datasets`` without the ``hf`` path's ``load_from_disk``."""

    def load_from_disk(*args, **kwargs):
        raise NotImplementedError(
            "--dataset_type hf needs Hugging Face's datasets package, which is not installed here (datasets is a "
            "stand-in for the gpt_jsonl path); pip install datasets, or use --dataset_type gpt_jsonl"
        )

    module = types.ModuleType("datasets")
    module.load_from_disk = load_from_disk
    return {"datasets": module}


STAND_INS = {
    "transformer_engine": (_transformer_engine, "fp8_autocast is jmp's fp8"),
    "datasets": (_datasets, "load_from_disk raises; the gpt_jsonl path only"),
}


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, modules: dict[str, types.ModuleType]):
        self.modules = modules

    def create_module(self, spec):
        return self.modules[spec.name]

    def exec_module(self, module):
        pass


class StandInFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: answers for a stand-in package only when no other finder found the real one."""

    def __init__(self):
        self.modules: dict[str, types.ModuleType] = {}

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root not in STAND_INS:
            return None
        if root not in self.modules:
            make, what = STAND_INS[root]
            self.modules |= make()
            _note(f"{root} is not installed: a stand-in ({what})")
        if fullname not in self.modules:
            return None
        package = any(name.startswith(fullname + ".") for name in self.modules)
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(self.modules), is_package=package)


# --- flash attention --------------------------------------------------------------------------------------------


def sdpa_for_flash_attention_2() -> bool:
    """Without ``flash_attn``, ``attn_implementation="flash_attention_2"`` becomes ``"sdpa"``; True if it may."""
    if _installed("flash_attn"):
        return False
    import transformers

    auto = transformers.AutoModelForCausalLM

    def swapped(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            if kwargs.get("attn_implementation") == "flash_attention_2":
                _note(
                    'attn_implementation="flash_attention_2" needs the flash_attn package (CUDA): "sdpa" instead, '
                    "F.scaled_dot_product_attention, which jmp lowers to jax.nn.dot_product_attention"
                )
                kwargs["attn_implementation"] = "sdpa"
            return method(*args, **kwargs)

        return classmethod(call)

    auto.from_config = swapped(auto.from_config.__func__)
    auto.from_pretrained = swapped(auto.from_pretrained.__func__)
    return True


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: smp_v2_host.py SCRIPT [args...]")
    script = os.path.abspath(argv[0])
    sys.meta_path.append(StandInFinder())
    cuda_calls_for_a_cpu_host()
    sdpa_for_flash_attention_2()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        # printed here as well: under jmp.launch, once jmp has started, an uncaught error's traceback may not
        # reach the launcher's output before the process ends (as for the SMP v1 scripts' smp_v1_host.py)
        traceback.print_exc()
        sys.stderr.flush()
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
