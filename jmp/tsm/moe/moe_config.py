"""``torch.sagemaker.moe.moe_config.MoEConfig``: SMP v2's mixture-of-experts options, given to ``tsm.transform``.

jmp keeps the model's own MoE layer and splits its experts over ``ep`` (``jmp.sharding.experts``) when
``smp_moe``; the other options choose among SMP's implementations and are accepted with a notice.
"""

from __future__ import annotations

import dataclasses
import logging

from jmp.errors import ConfigError
from jmp.runtime import notices

LOAD_BALANCING = ("sinkhorn", "balanced", "aux_loss", "none")
_ROUTER = "jmp keeps the model's own router (Hugging Face's top-k softmax, its auxiliary loss when the model asks)"
# option -> (the value that is what jmp does, or SMP's default where nothing in jmp matches it; the log level when
# another value is given; what jmp does)
_ALTERNATIVES = {
    "moe_load_balancing": ("aux_loss", logging.WARNING, _ROUTER),
    "global_token_shuffle": (False, logging.INFO, "tokens go to their experts' devices with one all-to-all over ep"),
    "moe_all_to_all_dispatcher": (True, logging.INFO, "tokens go to their experts' devices with an all-to-all"),
    "use_cpu_initialization": (False, logging.INFO, "parameters are initialised where jmp places them"),
    "moe_aux_loss_coeff": (0.001, logging.INFO, _ROUTER),
    "moe_z_loss_coeff": (0.001, logging.INFO, _ROUTER),
    "random_seed": (12345, logging.INFO, "expert weights are initialised from the config's random_seed"),
}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """SMP v2's ``MoEConfig``: the mixture-of-experts options of ``tsm.transform(model, config=...)``."""

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def __post_init__(self):
        if self.moe_load_balancing not in LOAD_BALANCING:
            raise ConfigError(
                f"MoEConfig: moe_load_balancing must be one of {LOAD_BALANCING}, not {self.moe_load_balancing!r}"
            )
        for name in ("smp_moe", "global_token_shuffle", "moe_all_to_all_dispatcher", "use_cpu_initialization"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"MoEConfig: {name} must be True or False, not {getattr(self, name)!r}")

    def log_what_jmp_does(self) -> None:
        """Say once, for each option whose value asks for something jmp does otherwise, what jmp does."""
        for name, (own, level, instead) in _ALTERNATIVES.items():
            value = getattr(self, name)
            if value != own:
                notices.log_once(
                    f"moe-config:{name}={value!r}",
                    level,
                    "MoEConfig(%s=%r) has no effect in jmp: %s",
                    name,
                    value,
                    instead,
                )
