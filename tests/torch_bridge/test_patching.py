"""A shared patch is installed by its first user and restored by its last; sessions leave torch as they found it."""

import types

import torch

from jmp.torch_bridge import dispatch
from jmp.torch_bridge.patching import SharedPatch


def test_a_shared_patch_is_installed_on_first_enter_and_restored_on_last_exit():
    target = types.SimpleNamespace(value="original")
    patch = SharedPatch((target, "value", "patched"))
    with patch:
        assert target.value == "patched"
        with patch:
            assert target.value == "patched"
        assert target.value == "patched"
    assert target.value == "original"


def test_a_shared_patch_restores_a_classmethod_as_the_descriptor_it_was():
    class Host:
        @classmethod
        def name(cls):
            return cls.__name__

    original = vars(Host)["name"]
    with SharedPatch((Host, "name", classmethod(lambda cls: "patched"))):
        assert Host.name() == "patched"
    assert vars(Host)["name"] is original and Host.name() == "Host"


def test_a_bridge_session_restores_torchs_apply_and_autocast_on_exit():
    before = (vars(torch.autograd.Function)["apply"], torch.is_autocast_enabled, torch.amp.autocast.__enter__)
    with dispatch.session():
        with dispatch.session():
            assert vars(torch.autograd.Function)["apply"] is not before[0]
            assert torch.is_autocast_enabled is not before[1]
    after = (vars(torch.autograd.Function)["apply"], torch.is_autocast_enabled, torch.amp.autocast.__enter__)
    assert after == before
