"""Torch autocast inside converted forwards: the op lists of ``torch.autocast``, applied by the dispatcher.

The tables map the ATen ops of torch's cast policies (``aten/src/ATen/autocast_mode.cpp``) to the torch-level
callables that reach the registry: torch's CPU lists for ``"cpu"``, its CUDA lists for any other device type.
The state is jmp's, one per context: ``forced(dtype)`` is jmp's way in, and while a bridge session runs,
``torch.autocast`` and its variants (Hugging Face's ``maybe_autocast`` too) push and pop it on any device type,
and torch's autocast queries answer from it. As in torch, only non-float64 floating tensors are cast, and
``out=`` / in-place calls never.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
import torch.nn.functional as F

from jmp.errors import JmpError, LoweringError
from jmp.torch_bridge import replica_calls
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.interop import tensor_to_array
from jmp.torch_bridge.patching import SharedPatch
from jmp.torch_bridge.tensor import JaxTensor

T = torch.Tensor

# Cast policies (torch's ``CastPolicy``; fp32_append_dtype, used for ``norm``, acts like fp32_set_opt_dtype
# at the torch-function level, where ``norm`` takes a dtype).
LOWER_PRECISION = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
PROMOTE = "promote"
BANNED = "banned"  # CUDA autocast refuses binary_cross_entropy

LOWER_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
_CASTABLE = {torch.float32, torch.float16, torch.bfloat16}  # floating, not float64
_ARRAY_DTYPES = {np.dtype(to_jax_dtype(d)): d for d in _CASTABLE}

# torch's lists, by ATen op name (torch 2.x: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, ..., and the
# AutocastCPU registrations), then the torch-level composites the bridge lowers whole.
_CUDA_LISTS = {
    LOWER_PRECISION: """_convolution convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
        conv_transpose3d prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
        chain_matmul linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention""",
    FP32: """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm
        group_norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
        upsample
        cross_entropy_loss normalize gaussian_nll_loss multilabel_soft_margin_loss""",
    FP32_SET_OPT_DTYPE: """prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm
        softmin linalg_norm""",
    PROMOTE: "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
    BANNED: "binary_cross_entropy",
}
_CPU_LISTS = {
    LOWER_PRECISION: """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear _convolution matmul
        conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
        einsum chain_matmul linalg_multi_dot tensordot""",
    # Not mapped: reflection_pad1d/2d and replication_pad1d/2d/3d (F.pad reaches them only for some modes
    # and ranks) and the private ops.
    FP32: """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist trace
        view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d mse_loss cosine_embedding_loss nll_loss hinge_embedding_loss
        poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits
        fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
        fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
        adaptive_max_pool3d linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq
        linalg_inv_ex""",
    PROMOTE: "stack cat index_copy hstack vstack dstack column_stack row_stack",
}

# Callables an ATen op is reached through besides torch.<op>, Tensor.<op>, F.<op>, torch.linalg.* and torch.fft.*.
_ALSO = {
    "matmul": (T.__matmul__, T.__rmatmul__),
    "pow": (T.__pow__, T.__rpow__),
    "acos": (torch.arccos, T.arccos),
    "asin": (torch.arcsin, T.arcsin),
    "expm1": (torch.special.expm1,),
    "log1p": (torch.special.log1p,),
    "erfinv": (torch.special.erfinv,),
    "logsumexp": (torch.special.logsumexp,),
    "softmax": (torch.special.softmax,),
    "log_softmax": (torch.special.log_softmax,),
    "cat": (torch.concat, torch.concatenate),
    "cross": (torch.linalg.cross,),
    "cross_entropy_loss": (F.cross_entropy,),
    "grid_sampler": (F.grid_sample,),
    "upsample": (F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear),
}


def _callables(aten_name: str) -> set:
    found = list(_ALSO.get(aten_name, ()))
    for prefix, namespace in (("linalg_", torch.linalg), ("fft_", torch.fft)):
        if aten_name.startswith(prefix):
            found.append(getattr(namespace, aten_name.removeprefix(prefix), None))
    found += [getattr(namespace, aten_name, None) for namespace in (torch, T, F)]
    return {fn for fn in found if callable(fn)}


def _table(lists: dict[str, str]) -> dict[Any, str]:
    return {fn: policy for policy, names in lists.items() for name in names.split() for fn in _callables(name)}


# device type's lists -> {torch callable: cast policy}
POLICIES: dict[str, dict[Any, str]] = {"cuda": _table(_CUDA_LISTS), "cpu": _table(_CPU_LISTS)}


def policy(func: Any, device_type: str = "cuda") -> str | None:
    """The cast policy of torch callable ``func`` under ``device_type``'s autocast (None: runs unchanged)."""
    return _lists(device_type).get(func)


def _lists(device_type: str) -> dict[Any, str]:
    return POLICIES["cpu" if device_type == "cpu" else "cuda"]


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """One autocast region: whether it casts, to which lower-precision dtype, with which device type's lists."""

    enabled: bool
    dtype: torch.dtype
    device_type: str
    half_results: bool = False  # jmp's half-precision training: see ``forced``

    def cast(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``func``'s arguments (tensors or arrays) cast by its policy; unchanged if it has none."""
        rule = _lists(self.device_type).get(func)
        if rule is None or "out" in kwargs:
            return args, kwargs
        if rule == LOWER_PRECISION:
            target = self.dtype
        elif rule == FP32:
            target = torch.float32
        elif rule == PROMOTE:
            dtypes = {_castable_dtype(leaf) for leaf in _leaves((args, kwargs))} - {None}
            target = self.dtype if dtypes <= {self.dtype} else torch.float32
        elif rule == FP32_SET_OPT_DTYPE:
            return args, _with_float32_dtype(args, kwargs)
        else:
            raise LoweringError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (torch's "
                "CUDA autocast refuses them too). Many models use a sigmoid layer right before the binary cross "
                "entropy layer; combine the two with torch.nn.functional.binary_cross_entropy_with_logits or "
                "torch.nn.BCEWithLogitsLoss, which are safe to autocast."
            )
        return _cast_tree(args, target), {k: _cast_tree(v, target) for k, v in kwargs.items()}

    def run(self, func: Any, compute: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """``compute(args, kwargs)`` with the arguments cast by ``func``'s policy.

        With ``half_results``, a float32 op on half-precision inputs (and attention) runs under ``jax.checkpoint``, so
        its float32 internals are recomputed in the backward rather than kept.
        """
        if not self._recomputes(func, args, kwargs):
            return self.settle(func, args, compute(*self.cast(func, args, kwargs)))
        return _recomputed(lambda a, k: self.settle(func, args, compute(*self.cast(func, a, k))), args, kwargs)

    def _recomputes(self, func: Any, args: tuple, kwargs: dict) -> bool:
        if not self.half_results:
            return False
        first = next((leaf for leaf in _leaves(args) if _castable_dtype(leaf) is not None), None)
        if first is None or _castable_dtype(first) != self.dtype:
            return False
        if func is F.scaled_dot_product_attention:  # its softmax is float32 inside; dropout draws random bits
            return not (kwargs.get("dropout_p") or (len(args) > 4 and args[4]))
        return _lists(self.device_type).get(func) in (FP32, FP32_SET_OPT_DTYPE)

    def settle(self, func: Any, args: tuple, result: Any) -> Any:
        """With ``half_results``: a float32-policy op's same-shaped results on a half input come back in that dtype.

        Reductions to other shapes keep float32. ``args`` are the call's own, uncast.
        """
        if not self.half_results or _lists(self.device_type).get(func) not in (FP32, FP32_SET_OPT_DTYPE):
            return result
        first = next((leaf for leaf in _leaves(args) if _castable_dtype(leaf) is not None), None)
        if first is None or _castable_dtype(first) != self.dtype:
            return result
        shape = tuple(first.shape)

        def back(value: Any) -> Any:
            if type(value) in (tuple, list):
                return type(value)(back(item) for item in value)
            if _castable_dtype(value) == torch.float32 and tuple(value.shape) == shape:
                return _cast_tree(value, self.dtype)
            return value

        return back(result)


_STATE: contextvars.ContextVar[AutocastState | None] = contextvars.ContextVar("jmp_autocast", default=None)


def current() -> AutocastState | None:
    """The innermost autocast region of this context (enabled or not); None outside any."""
    return _STATE.get()


def active() -> AutocastState | None:
    """The autocast region that casts now, or None (one context-variable read: the dispatcher's check)."""
    state = _STATE.get()
    return state if state is not None and state.enabled else None


def forced(
    dtype: torch.dtype, device_type: str = "cuda", *, half_results: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Run the block under autocast to ``dtype`` (bfloat16 or float16) with ``device_type``'s op lists, on any device.

    ``torch.autocast`` regions inside nest as in torch. ``half_results``: float32-policy ops hand half-precision
    inputs their same-shaped results in ``dtype``, so activations stay half precision (torch keeps them float32).
    """
    if dtype not in LOWER_PRECISION_DTYPES:
        raise JmpError(f"autocast runs in torch.bfloat16 or torch.float16, not {dtype}")
    return set_within(_STATE, AutocastState(True, dtype, device_type, half_results))


def call(torch_fn: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a JAX-written layer's ``torch_fn``), its arrays cast by ``torch_fn``'s policy."""
    state = active()
    if state is None:
        return replica_calls.call(torch_fn, fn, args, kwargs)
    return state.run(torch_fn, lambda a, k: replica_calls.call(torch_fn, fn, a, k), args, kwargs)


def call_whole(torch_fn: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call`` for an ``fn`` that runs its own per-replica parts (``replica_calls``): it gets the whole batch."""
    state = active()
    if state is None:
        return fn(*args, **kwargs)
    return state.run(torch_fn, lambda a, k: fn(*a, **k), args, kwargs)


def _castable_dtype(leaf: Any) -> torch.dtype | None:
    """The torch dtype of a tensor or array that autocast may cast (floating, not float64), else None."""
    if isinstance(leaf, torch.Tensor):
        with torch._C.DisableTorchFunction():  # metadata only, never a lowered op
            dtype = leaf.dtype
        return dtype if dtype in _CASTABLE else None
    if isinstance(leaf, jax.Array):
        return _ARRAY_DTYPES.get(np.dtype(leaf.dtype))
    return None


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        value = tuple(value.values())
    if type(value) in (tuple, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _cast_tree(value: Any, target: torch.dtype) -> Any:
    if type(value) in (tuple, list):  # tensor lists (cat, stack, multi_dot); not torch.Size
        return type(value)(_cast_tree(item, target) for item in value)
    dtype = _castable_dtype(value)
    if dtype is None or dtype == target:
        return value
    jax_dtype = to_jax_dtype(target)
    if isinstance(value, JaxTensor):
        return JaxTensor(value.value.astype(jax_dtype))
    if isinstance(value, torch.Tensor):
        return JaxTensor(tensor_to_array(value).astype(jax_dtype))
    return value.astype(jax_dtype)


def _recomputed(compute: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
    """``compute(args, kwargs)`` under ``jax.checkpoint``, with the arguments' tensors and arrays as its inputs."""
    leaves, structure = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (torch.Tensor, jax.Array))]
    kinds: list = []  # per result leaf: its torch dtype (a tensor) or None (an array), filled while tracing

    def inner(*arrays: jax.Array) -> list:
        rebuilt = list(leaves)
        for i, array in zip(positions, arrays):
            rebuilt[i] = JaxTensor(array, _torch_dtype(leaves[i])) if isinstance(leaves[i], torch.Tensor) else array
        result_leaves, result_structure = jax.tree_util.tree_flatten(compute(*structure.unflatten(rebuilt)))
        kinds[:] = [(_torch_dtype(r) if isinstance(r, torch.Tensor) else None) for r in result_leaves]
        kinds.append(result_structure)
        return [r.value if isinstance(r, JaxTensor) else r for r in result_leaves]

    arrays = [leaves[i].value if isinstance(leaves[i], JaxTensor) else leaves[i] for i in positions]
    if any(isinstance(a, torch.Tensor) for a in arrays):  # a plain torch tensor among JaxTensors: no checkpoint
        return compute(args, kwargs)
    out = jax.checkpoint(inner)(*arrays)
    *dtypes, result_structure = kinds
    return result_structure.unflatten([a if d is None else JaxTensor(a, d) for a, d in zip(out, dtypes)])


def _torch_dtype(tensor: torch.Tensor) -> torch.dtype:
    with torch._C.DisableTorchFunction():
        return tensor.dtype


def _with_float32_dtype(args: tuple, kwargs: dict) -> dict:
    """Torch's fp32_set_opt_dtype: a half-precision input and no dtype given -> ``dtype=torch.float32``."""
    first = args[0] if args else kwargs.get("input")
    if _castable_dtype(first) in (None, torch.float32):
        return kwargs
    if kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
        return kwargs
    return {**kwargs, "dtype": torch.float32}


# --- torch.autocast inside sessions -----------------------------------------------------------------------------

_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_autocast_routed", default=False)
_AUTOCAST = torch.amp.autocast_mode.autocast
_ORIGINAL_METHODS = {name: _AUTOCAST.__dict__[name] for name in ("__init__", "__enter__", "__exit__")}


def _routed_init(
    self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, cache_enabled: Any = None
) -> None:
    init = _ORIGINAL_METHODS["__init__"]
    if not _ROUTED.get():
        return init(self, device_type, dtype, enabled, cache_enabled)
    # Torch turns CUDA autocast off where this process has no CUDA (with a warning); jmp runs the forward
    # on its own devices, so the request stands. Torch still validates the device type and finds the dtype.
    init(self, device_type, dtype, enabled and device_type != "cuda", cache_enabled)
    supported = self.fast_dtype in LOWER_PRECISION_DTYPES
    if enabled and device_type == "cuda" and not supported:
        message = f"autocast runs in torch.bfloat16 or torch.float16, not {self.fast_dtype}; disabling autocast"
        warnings.warn(message, stacklevel=2)
    self._jmp_enabled = enabled and supported


def _routed_enter(self: Any) -> Any:
    if not _ROUTED.get():
        return _ORIGINAL_METHODS["__enter__"](self)
    # an autocast made outside sessions (a decorator) has only torch's decision, ``_enabled``
    enabled = self.__dict__.get("_jmp_enabled", self._enabled)
    token = _STATE.set(AutocastState(enabled, self.fast_dtype, self.device))
    self.__dict__.setdefault("_jmp_tokens", []).append(token)
    return self


def _routed_exit(self: Any, *exc_info: Any) -> Any:
    tokens = self.__dict__.get("_jmp_tokens")
    if tokens:
        _STATE.reset(tokens.pop())
        return False
    return _ORIGINAL_METHODS["__exit__"](self, *exc_info)


def _query(name: str, answer: Callable[[AutocastState], Any]) -> tuple[str, Callable] | None:
    """(name, the routed function) for one of torch's autocast-state queries, if torch has it."""
    original = getattr(torch, name, None)
    if original is None:
        return None

    def routed(*args: Any, **kwargs: Any) -> Any:
        state = _STATE.get() if _ROUTED.get() else None
        return original(*args, **kwargs) if state is None else answer(state)

    routed.__name__ = routed.__qualname__ = name
    return name, routed


_enabled, _dtype = operator.attrgetter("enabled"), operator.attrgetter("dtype")
_QUERIES = [
    query
    for query in (
        _query("is_autocast_enabled", _enabled),
        _query("is_autocast_cpu_enabled", _enabled),
        _query("get_autocast_dtype", _dtype),
        _query("get_autocast_gpu_dtype", _dtype),
        _query("get_autocast_cpu_dtype", _dtype),
    )
    if query is not None
]


_TORCH_IS_ENABLED, _TORCH_GET_DTYPE = torch.is_autocast_enabled, torch.get_autocast_dtype


def _ambient() -> AutocastState | None:
    """Torch's autocast region open in this thread (CUDA's first) as jmp state; the outermost session keeps it."""
    for device_type in ("cuda", "cpu"):
        if _TORCH_IS_ENABLED(device_type):
            return AutocastState(True, _TORCH_GET_DTYPE(device_type), device_type)
    return None


_ROUTED_METHODS = {"__init__": _routed_init, "__enter__": _routed_enter, "__exit__": _routed_exit}
_PATCH = SharedPatch(
    *[(_AUTOCAST, name, method) for name, method in _ROUTED_METHODS.items()],
    *[(torch, name, routed) for name, routed in _QUERIES],
)


class Route:
    """Entered by the outermost bridge session: ``torch.autocast`` and torch's autocast queries use jmp's state.

    In a context with a session, the replaced autocast class and queries act on jmp's state; elsewhere (other
    threads) they call torch's own. The last session out restores torch's.
    """

    def __enter__(self) -> None:
        _PATCH.__enter__()
        ambient = _ambient() if _STATE.get() is None else None
        self._tokens = (_ROUTED.set(True), None if ambient is None else _STATE.set(ambient))

    def __exit__(self, *exc_info: Any) -> None:
        routed_token, state_token = self._tokens
        if state_token is not None:
            _STATE.reset(state_token)
        _ROUTED.reset(routed_token)
        _PATCH.__exit__(*exc_info)
