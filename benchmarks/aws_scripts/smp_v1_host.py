"""Run one of AWS's SMP v1 example scripts as SageMaker would, on a host without CUDA: ``smp_v1_host.py SCRIPT
[args...]``, SCRIPT the ``train.py`` of a checkout's ``gpt2/`` or ``flan-t5/`` (``checkout.py``).

What this adds around the unmodified script is what ``jmp.launch`` does not do yet (each piece says so when it
acts, on stderr, once per process), so the scripts need no edit for it:

- ``smdistributed.modelparallel.torch`` -> jmp, only when that import fails (the launcher's alias, once it
  has one, wins);
- ``torch.cuda.synchronize()`` and ``torch.cuda.set_device(i)`` as no-ops when torch has no CUDA: the scripts
  call them on every step / once, and a CPU build of torch raises on both (``AssertionError: Torch not
  compiled with CUDA enabled``; ``AttributeError: ... _cuda_setDevice``). There is nothing to synchronise,
  and JAX, not torch, picks the device of a jmp process;
- flan-t5's ``t5_flash_attn.py`` imports ``flash_attn`` (a CUDA-only package) at its top: without the package,
  the module is imported here first with a stand-in ``flash_attn`` whose ``FlashAttention`` raises when built
  (``train.py`` builds it only with ``--flash_attention 1``; the runs pass 0). The stand-in is visible to that
  import alone: Hugging Face's own checks for ``flash_attn`` still find none;
- with ``SMP_EXAMPLES_T5_DROPOUT_RATE`` set, every ``T5Config`` takes that ``dropout_rate`` (flan-t5's
  ``model_config.py`` fixes it at 0.1, and a comparison with PyTorch needs the same, mask-free, forward);
- with ``SMP_EXAMPLES_INITIAL_STATE`` set, rank 0 saves the ``state_dict()`` of each ``DistributedModel`` as
  built to that file (float32): under ``delayed_parameter_initialization`` the weights are drawn on the devices
  (SMP's too), not by torch's generator, so a PyTorch reference can only start from the same weights by
  reading them.

Then the script runs as ``__main__`` with its own folder first on ``sys.path``, as ``python SCRIPT``
would; an error it raises is printed here too (see ``main``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
import traceback
import types

HARNESS_NOTE = "smp_v1_host:"


def _note(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{HARNESS_NOTE} {message}", file=sys.stderr, flush=True)


def alias_smdistributed() -> bool:
    """Make ``import smdistributed.modelparallel.torch`` give jmp when nothing provides it; True if it did."""
    try:
        importlib.import_module("smdistributed.modelparallel.torch")
        return False
    except ImportError:
        pass
    import jmp
    import jmp.nn

    root = types.ModuleType("smdistributed")
    root.__path__ = []
    modelparallel = types.ModuleType("smdistributed.modelparallel")
    modelparallel.__path__ = []
    modelparallel.__version__ = jmp.__version__
    modelparallel.torch = jmp
    root.modelparallel = modelparallel
    sys.modules |= {
        "smdistributed": root,
        "smdistributed.modelparallel": modelparallel,
        "smdistributed.modelparallel.torch": jmp,
        "smdistributed.modelparallel.torch.nn": jmp.nn,
    }
    _note("smdistributed.modelparallel.torch aliased to jmp here (jmp.launch did not provide it)")
    return True


def cuda_calls_as_no_ops() -> list[str]:
    """On a torch without CUDA, the CUDA calls the scripts make unconditionally do nothing; returns their names."""
    import torch

    if torch.cuda.is_available():
        return []
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.set_device = lambda device: None
    names = ["torch.cuda.synchronize", "torch.cuda.set_device"]
    _note(f"{', '.join(names)} are no-ops here (torch has no CUDA; jmp does not provide this)")
    return names


def t5_flash_attn_without_flash_attn(folder: str) -> bool:
    """Import ``folder``'s ``t5_flash_attn`` (flan-t5's) with a stand-in ``flash_attn`` when that package is
    missing, the stand-in removed again after; True if it was. The script's own import then finds the module."""
    if not os.path.isfile(os.path.join(folder, "t5_flash_attn.py")) or importlib.util.find_spec("flash_attn"):
        return False
    import transformers.models.t5.modeling_t5  # noqa: F401 (its own checks for flash_attn run without the stand-in)

    class FlashAttention:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                "flash_attn is not installed (it builds for CUDA only): run flan-t5's train.py with --flash_attention 0"
            )

    root = types.ModuleType("flash_attn")
    root.__path__ = []
    module = types.ModuleType("flash_attn.flash_attention")
    module.FlashAttention = FlashAttention
    root.flash_attention = module
    stand_ins = {"flash_attn": root, "flash_attn.flash_attention": module}
    sys.modules |= stand_ins
    sys.path.insert(0, folder)
    try:
        importlib.import_module("t5_flash_attn")
    finally:
        sys.path.remove(folder)
        for name in stand_ins:
            sys.modules.pop(name)
    _note("flash_attn is not installed: t5_flash_attn imported with a stand-in whose FlashAttention raises when built")
    return True


def t5_dropout_from_environment() -> float | None:
    """``T5Config``'s ``dropout_rate`` forced to ``$SMP_EXAMPLES_T5_DROPOUT_RATE`` when that is set."""
    if "SMP_EXAMPLES_T5_DROPOUT_RATE" not in os.environ:
        return None
    import transformers

    rate = float(os.environ["SMP_EXAMPLES_T5_DROPOUT_RATE"])
    original = transformers.T5Config.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "dropout_rate": rate})

    transformers.T5Config.__init__ = init
    _note(f"T5Config's dropout_rate is {rate} (SMP_EXAMPLES_T5_DROPOUT_RATE; the script fixes 0.1)")
    return rate


def initial_state_to_file() -> str | None:
    """With ``$SMP_EXAMPLES_INITIAL_STATE`` set, each ``DistributedModel``'s weights as built go to that file
    (rank 0 writes; every process gathers, as ``state_dict()`` asks); returns the path."""
    path = os.environ.get("SMP_EXAMPLES_INITIAL_STATE")
    if not path:
        return None
    import torch

    import jmp

    original = jmp.DistributedModel.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        weights = {name: value.float() for name, value in self.state_dict().items()}
        if os.environ.get("RANK", "0") == "0":
            torch.save(weights, path)

    jmp.DistributedModel.__init__ = init
    _note(f"each DistributedModel's initial state_dict goes to {path} (SMP_EXAMPLES_INITIAL_STATE)")
    return path


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: smp_v1_host.py SCRIPT [args...]")
    script = os.path.abspath(argv[0])
    alias_smdistributed()
    cuda_calls_as_no_ops()
    t5_flash_attn_without_flash_attn(os.path.dirname(script))
    t5_dropout_from_environment()
    initial_state_to_file()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        # printed here as well: under jmp.launch, once smp.init has run, the excepthook's traceback of an
        # uncaught error does not reach the launcher's output (the process ends with code 1, silently)
        traceback.print_exc()
        sys.stderr.flush()
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
