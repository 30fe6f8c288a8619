"""``python -m jmp.plan``: collective bytes read from a compiled program, and a small model's plan for 8 H100s."""

from __future__ import annotations

import os

import pytest

from jmp import plan
from jmp.compiled_step import gpu_target
from jmp.errors import JmpError

transformers = pytest.importorskip("transformers")
SMALL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)


def test_plan_of_a_small_gpt2_on_8_h100s(tmp_path):
    """fsdp8: each sharded bf16 parameter is gathered in the forward and again in the backward (the position
    embedding once: its gradient needs no weights), and each sharded gradient reduce-scattered, (n-1)/n of it sent."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        gpu_target.devices("h100", 8)
    except JmpError as error:
        pytest.skip(f"no deviceless CUDA compiler here: {error}")
    transformers.GPT2Config(**SMALL).to_json_file(tmp_path / "config.json")
    layout = '{"sharded_data_parallel_degree": 8}'
    found = plan.main([str(tmp_path), "--devices", "8", "--layout", layout, "--batch", "16", "--seq", "32"])
    width, layers, vocab, positions = 64, 2, 256, 32
    per_layer = 2 * 2 * width + (width * 3 * width + 3 * width) + (width * width + width) + 2 * (4 * width * width)
    per_layer += 4 * width + width
    params = vocab * width + positions * width + layers * per_layer + 2 * width
    replicated = layers * (2 * 2 * width + 3 * width + width + 4 * width + width) + 2 * width  # biases and norms
    sharded = params - replicated
    assert found["collectives"]["all-gather"]["bytes"] == 7 / 8 * 2 * (2 * sharded - positions * width)
    assert found["collectives"]["reduce-scatter"]["bytes"] == 7 / 8 * 2 * sharded
    tokens = 16 * 32
    assert found["flops"] == (6 * params * tokens + 12 * layers * positions * width * tokens) / 8
    assert found["memory"]["master_copies"] == (sharded / 8 + replicated) * 4
