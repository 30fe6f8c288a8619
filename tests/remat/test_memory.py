"""Temporary memory of the compiled step (``memory_analysis``), GPT-2 with 4 layers, d_model 256, sequence 256, batch 8.

Compiled only, never run. Without checkpointing the backward pass keeps every layer's activations
(attention weights above all); ``each`` keeps each layer's input and recomputes one layer at a time;
``group_2`` recomputes two; ``contiguous`` recomputes all four at once, close to no checkpointing
(see ``jmp.remat.strategies``); ``save_matmuls`` keeps the matmul outputs on top of ``each``.
"""

import pytest

import jmp as smp
from tests.remat.helpers import gpt2, lm_step, token_batch

LENGTH = 256


@pytest.fixture(scope="module")
def temporaries() -> dict[str, int]:
    """Bytes of temporaries per device of the step program, by annotation (None: no checkpointing)."""
    smp.init({"scan_layers": False})  # per-layer programs (checkpointing inside a scan: tests/stacks)
    ids = token_batch(8, LENGTH, vocab=512)
    sizes = {}
    for strategy, policy in (
        (None, None),
        ("each", None),
        ("group_2", None),
        ("contiguous", None),
        ("each", "save_matmuls"),
    ):
        model = smp.DistributedModel(gpt2(layers=4, width=256, positions=LENGTH, vocab=512))
        if strategy is not None:
            smp.set_activation_checkpointing(model.module.transformer.h, strategy=strategy, policy=policy)
        compiled = lm_step.lower(model, ids).compile()
        sizes[f"{strategy}:{policy}"] = compiled.memory_analysis().temp_size_in_bytes
    return sizes


def test_checkpointing_each_layer_needs_at_most_half_the_temporaries(temporaries):
    assert temporaries["each:None"] <= 0.5 * temporaries["None:None"]


def test_larger_groups_recompute_more_at_once_and_need_more(temporaries):
    none, each = temporaries["None:None"], temporaries["each:None"]
    assert each < temporaries["group_2:None"] < temporaries["contiguous:None"] <= none


def test_saving_matmul_outputs_lands_between_full_recompute_and_none(temporaries):
    assert temporaries["each:None"] < temporaries["each:save_matmuls"] < temporaries["None:None"]
