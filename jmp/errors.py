"""Exceptions a jmp user can hit. Each message says what was wrong, where, and what to do."""

from __future__ import annotations


class JmpError(Exception):
    """Base class of every error jmp raises on purpose."""


class ConfigError(JmpError, ValueError):
    """An smp configuration key or value is invalid."""


class ConversionError(JmpError):
    """A torch module could not be converted to a Flax NNX module."""


class UnsupportedOpError(JmpError, NotImplementedError):
    """A torch op has no JAX lowering."""


class LoweringError(JmpError):
    """A lowered torch op failed on the values it was given."""


class ShapeMismatchError(LoweringError, RuntimeError):
    """Shapes a torch op rejects (a Linear fed the wrong features): torch's RuntimeError and message."""


class TracedControlFlowError(JmpError):
    """Python needed a concrete value (bool, int, shape) from a traced array."""


class StepError(JmpError):
    """A step function, its inputs or the model/optimizer calls around it are misused."""


class ArgumentTypeError(JmpError, TypeError):
    """A jmp function was given a value of the wrong kind (a module where an optimizer goes, ...)."""


class ModelLookupError(JmpError, LookupError):
    """jmp could not tell which ``DistributedModel`` is meant (none, or several, match)."""


class OptimizerError(JmpError):
    """An optimizer, its options or its use is not supported."""


class StateDictError(JmpError, RuntimeError):
    """A state dict does not fit the model or optimizer it is loaded into."""


class PipelineError(JmpError):
    """The model cannot be cut into pipeline stages as asked, or a step does not fit the cut."""


class ActivationCheckpointingError(JmpError):
    """A module cannot be checkpointed as asked (layers that do not chain, a layer missing from its group)."""


class CheckpointError(JmpError, RuntimeError):
    """A checkpoint cannot be saved or resumed (missing path or tag, incomplete, corrupted, or another model's)."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint's files cannot be read: an incomplete, truncated or corrupted checkpoint."""


class CommError(JmpError, RuntimeError):
    """A host collective did not complete: a peer missed its call (``JMP_COMM_TIMEOUT``) or the runtime failed."""
