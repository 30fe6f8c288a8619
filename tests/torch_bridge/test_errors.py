"""Bad input gets a clear jmp error: what, where (module path, source line), and what to do."""

import jax
import jax.numpy as jnp
import pytest
import torch
from torch import nn

import jmp
from jmp.errors import ConversionError, LoweringError, TracedControlFlowError, UnsupportedOpError


class SpectralBlock(nn.Module):
    def forward(self, x):
        return torch.linalg.matrix_exp(x).abs()  # no lowering registered


class Encoder(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


def test_unsupported_op_names_the_op_module_line_and_the_fix():
    converted = jmp.torch_bridge.convert(Encoder(SpectralBlock()))
    with pytest.raises(UnsupportedOpError) as error:
        converted(jnp.ones((2, 8)))
    message = str(error.value)
    assert "torch.linalg.matrix_exp" in message
    assert "module 'block' (SpectralBlock)" in message
    assert "test_errors.py" in message and "torch.linalg.matrix_exp(x).abs()" in message
    assert "register_lowering(torch.linalg.matrix_exp)" in message


class DataDependentBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_python_branch_on_a_traced_value_names_the_module_and_line():
    converted = jmp.torch_bridge.convert(Encoder(DataDependentBranch()))
    assert float(converted(jnp.ones(3)).sum()) == 6.0  # concrete values: fine outside jit
    with pytest.raises(TracedControlFlowError) as error:
        jax.jit(lambda x: converted(x))(jnp.ones(3))
    message = str(error.value)
    assert "module 'block' (DataDependentBranch)" in message
    assert "if x.sum() > 0:" in message
    assert "torch.where" in message


class BooleanMaskSelect(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def test_boolean_mask_indexing_under_jit_is_a_traced_control_flow_error():
    converted = jmp.torch_bridge.convert(BooleanMaskSelect())
    assert float(converted(jnp.array([1.0, -1.0, 2.0]))) == 3.0
    with pytest.raises(TracedControlFlowError, match="x\\[x > 0\\]"):
        jax.jit(lambda x: converted(x))(jnp.array([1.0, -1.0, 2.0]))


class ShapeMismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 5))

    def forward(self, x):
        return torch.matmul(x, self.weight)


def test_a_lowering_that_rejects_its_inputs_says_which_op():
    converted = jmp.torch_bridge.convert(ShapeMismatch())
    # shapes torch rejects: torch's RuntimeError and wording, a LoweringError too
    with pytest.raises(
        LoweringError,
        match=r"^mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\) \(in module '<root>' \(ShapeMismatch\)",
    ):
        converted(jnp.ones((2, 3)))


def test_torchscript_and_meta_modules_are_refused_at_conversion():
    with pytest.raises(ConversionError, match="TorchScript"):
        jmp.torch_bridge.convert(torch.jit.script(nn.Linear(2, 2)))
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ConversionError, match="'weight' is on the meta device"):
        jmp.torch_bridge.convert(meta)


def test_attribute_names_that_clash_with_the_converted_module_are_refused():
    module = nn.Module()
    module.rngs = nn.Linear(2, 2)
    with pytest.raises(ConversionError, match="'rngs'"):
        jmp.torch_bridge.convert(module)
