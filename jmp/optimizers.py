"""``smp.optimizers``: NVIDIA apex's fused optimizers as torch optimizers with apex's arguments and update rules.

``step()`` updates eagerly for a plain ``nn.Module``; ``smp.DistributedOptimizer`` runs the same rule compiled
(``jmp.optim.torch_rules``). LAMB and NovoGrad take norms per tensor, so a pipelined model refuses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from jmp.errors import OptimizerError


def _refuse(name: str, **options: bool) -> None:
    for option, given in options.items():
        if given:
            raise OptimizerError(
                f"{name}({option}=True) is not implemented in jmp; leave it False (its default), or use "
                f"torch.optim.{'Adam' if name == 'FusedAdam' else 'AdamW'} with {option}=True"
            )


class _ApexOptimizer(torch.optim.Optimizer):
    """What apex's fused optimizers share: ``set_grad_none`` and per-parameter state made on first use."""

    def __init__(self, params: Iterable, defaults: dict, set_grad_none: bool):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        self._prepare()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), **self._first_state(p, group))
                state["step"] += 1
                self._update(p, state, group, *group["betas"])
        return loss

    def _prepare(self) -> None:
        """Work over all gradients before the per-parameter updates."""

    def _first_state(self, p: torch.Tensor, group: dict) -> dict:
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


class FusedAdam(_ApexOptimizer):
    """apex's ``FusedAdam``: Adam, AdamW (``adam_w_mode``, the default)."""

    def __init__(
        self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
        weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True, capturable: bool = False,
        master_weights: bool = False,
    ):  # fmt: skip
        _refuse("FusedAdam", amsgrad=amsgrad, capturable=capturable, master_weights=master_weights)
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
        )  # fmt: skip
        super().__init__(params, defaults, set_grad_none)

    def _update(self, p, state, group, beta1, beta2) -> None:
        p.add_(_adam_direction(p, p.grad, state, group, beta1, beta2, grad_averaging=True), alpha=-group["lr"])


class FusedLAMB(_ApexOptimizer):
    """apex's ``FusedLAMB``: Adam's bias-corrected direction plus decay, scaled per tensor by ``||p|| / ||direction||``.

    The gradients of all groups are first scaled to a global norm of at most ``max_grad_norm``; the trust ratio
    (1 where a norm is 0) applies when the group decays weights or ``use_nvlamb``.
    """

    def __init__(
        self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
        amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True, set_grad_none: bool = True,
        max_grad_norm: float = 1.0, use_nvlamb: bool = False,
    ):  # fmt: skip
        _refuse("FusedLAMB", amsgrad=amsgrad)
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
            adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )  # fmt: skip
        super().__init__(params, defaults, set_grad_none)

    def _prepare(self) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        max_norm = self.defaults["max_grad_norm"]
        self._clip = norm / max_norm if max_norm > 0 and norm > max_norm else torch.ones(())

    def _update(self, p, state, group, beta1, beta2) -> None:
        grad = p.grad / self._clip
        direction = _adam_direction(p, grad, state, group, beta1, beta2, grad_averaging=group["grad_averaging"])
        ratio = torch.ones(())
        if group["weight_decay"] != 0 or group["use_nvlamb"]:
            p_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(direction)
            if p_norm > 0 and d_norm > 0:
                ratio = p_norm / d_norm
        p.add_(direction * ratio, alpha=-group["lr"])


FusedLamb = FusedLAMB


class FusedNovoGrad(_ApexOptimizer):
    """apex's ``FusedNovoGrad``: Adam's first moment over one running gradient norm per tensor (``_blend_norm``).

    The norm starts at the first gradient's (0 with ``init_zero``) and is bias-corrected by ``sqrt(1 - b2^t)``;
    with ``reg_inside_moment`` the moment is taken of ``g / (v + eps) + weight_decay * p`` itself.
    """

    def __init__(
        self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
        amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True, norm_type: int = 2,
        init_zero: bool = False, set_grad_none: bool = True,
    ):  # fmt: skip
        _refuse("FusedNovoGrad", amsgrad=amsgrad)
        if norm_type not in (0, 2):
            raise OptimizerError(f"FusedNovoGrad(norm_type={norm_type!r}): use 2 (L2 norm) or 0 (largest magnitude)")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
            reg_inside_moment=reg_inside_moment, grad_averaging=grad_averaging, norm_type=norm_type,
            init_zero=init_zero,
        )  # fmt: skip
        super().__init__(params, defaults, set_grad_none)

    def _first_state(self, p: torch.Tensor, group: dict) -> dict:
        start = torch.zeros(()) if group["init_zero"] else _norm(p.grad, group["norm_type"])
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": start}  # the running norm: one per tensor

    def _update(self, p, state, group, beta1, beta2) -> None:
        norm = _norm(p.grad, group["norm_type"])
        state["exp_avg_sq"] = _blend_norm(state["exp_avg_sq"], norm, beta2, group["norm_type"])
        p.sub_(_novograd_step(p, p.grad, state, group, beta1, beta2), alpha=group["lr"])


def _adam_direction(p, grad, state, group, beta1, beta2, *, grad_averaging: bool) -> torch.Tensor:
    """Update the moments in ``state``; the step direction (before the learning rate)."""
    decay = group["weight_decay"]
    if not group["adam_w_mode"]:
        grad = grad + decay * p
    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1 if grad_averaging else 1.0)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = state["step"]
    correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
    correction2 = 1 - beta2**step if group["bias_correction"] else 1.0
    direction = (state["exp_avg"] / correction1) / ((state["exp_avg_sq"] / correction2).sqrt() + group["eps"])
    if group["adam_w_mode"]:
        direction = direction + decay * p
    return direction


def _norm(grad: torch.Tensor, norm_type: int) -> torch.Tensor:
    return grad.abs().max() if norm_type == 0 else grad.pow(2).sum().sqrt()


def _blend_norm(average: torch.Tensor, norm: torch.Tensor, beta2: float, norm_type: int) -> torch.Tensor:
    """NovoGrad's running gradient norm: ``sqrt(b2 a^2 + (1 - b2) n^2)`` (L2), ``b2 a + (1 - b2) n`` (max)."""
    if norm_type == 0:
        return beta2 * average + (1 - beta2) * norm
    return (beta2 * average * average + (1 - beta2) * norm * norm).sqrt()


def _novograd_step(p, grad, state, group, beta1, beta2) -> torch.Tensor:
    """Update the first moment in ``state``; the step before the learning rate."""
    step = state["step"]
    correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
    correction2 = (1 - beta2**step).sqrt() if group["bias_correction"] else 1.0
    denominator = state["exp_avg_sq"] / correction2 + group["eps"]
    keep = 1 - beta1 if group["grad_averaging"] else 1.0
    if group["reg_inside_moment"]:  # the paper's form: the normalised gradient and its decay enter the moment
        state["exp_avg"].mul_(beta1).add_(grad / denominator + group["weight_decay"] * p, alpha=keep)
        return state["exp_avg"] / correction1
    state["exp_avg"].mul_(beta1).add_(grad, alpha=keep)
    return (state["exp_avg"] / correction1) / denominator + group["weight_decay"] * p
