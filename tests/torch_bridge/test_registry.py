"""The lowering registry: a second registration of an op replaces the first, and says so unless asked to."""

import subprocess
import sys
import textwrap
import warnings

import pytest

import jmp
from jmp.torch_bridge import registry

OP = "jmptest::registered_twice"


@pytest.fixture
def clean_op():
    yield OP
    registry.LOWERINGS.pop(OP, None)


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if marker in line and "_line_of" not in line)


def test_registering_an_op_twice_warns_naming_both_sites_and_the_second_wins(clean_op):
    @jmp.torch_bridge.register_lowering(clean_op)  # first site
    def first(x):
        return x

    with pytest.warns(UserWarning, match="already has a lowering") as caught:

        @jmp.torch_bridge.register_lowering(clean_op)  # second site
        def second(x):
            return x

    message = str(caught[0].message)
    assert f"test_registry.py:{_line_of('# first site')}" in message
    assert f"test_registry.py:{_line_of('# second site')}" in message
    assert message.index(f":{_line_of('# first site')}") < message.index(f":{_line_of('# second site')}")
    assert caught[0].filename == __file__
    assert registry.lookup(clean_op).fn is second


def test_replace_true_registers_again_without_a_warning(clean_op):
    jmp.torch_bridge.register_lowering(clean_op)(lambda x: x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @jmp.torch_bridge.register_lowering(clean_op, replace=True)
        def again(x):
            return x

    assert registry.lookup(clean_op).fn is again


def test_one_registration_naming_an_op_through_two_aliases_does_not_warn(clean_op):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp.torch_bridge.register_lowering(clean_op, clean_op)(lambda x: x)


def test_import_jmp_registers_no_op_twice():
    script = """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import jmp
        print("\\n".join(str(w.message) for w in caught if "already has a lowering" in str(w.message)))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
