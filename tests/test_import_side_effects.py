"""``import jmp`` leaves the process as it found it, apart from the torch patches the README lists."""

import subprocess
import sys
import textwrap


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)


def test_a_scripts_logging_config_after_import_jmp_takes_effect():
    done = _run(
        """
        import logging
        import jmp
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        logging.getLogger("train").info("Batch 0 Loss: 1.25")
        """
    )
    assert done.returncode == 0, done.stderr
    assert "train Batch 0 Loss: 1.25" in done.stderr


def test_import_jmp_adds_no_root_handler_and_loads_no_orbax():
    done = _run(
        """
        import logging, sys
        import jmp
        assert logging.getLogger().handlers == [], logging.getLogger().handlers
        assert logging.getLogger().level == logging.WARNING
        assert not [m for m in sys.modules if m.startswith("orbax")]
        """
    )
    assert done.returncode == 0, done.stderr


def test_checkpoints_keep_the_scripts_own_logging(tmp_path):
    done = _run(
        f"""
        import logging
        import torch
        import jmp as smp
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        smp.init({{}})
        model = smp.DistributedModel(torch.nn.Linear(4, 2))
        smp.save_checkpoint({str(tmp_path)!r}, "t", partial=True, model=model)
        smp.resume_from_checkpoint({str(tmp_path)!r}, tag="t")
        assert len(logging.getLogger().handlers) == 1, logging.getLogger().handlers
        logging.getLogger("train").info("after the checkpoint")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("train after the checkpoint") == 1


def test_import_jmp_changes_only_the_torch_functions_the_readme_lists():
    done = _run(
        """
        import torch, torch.nn.functional, torch.nn.utils, torch.nn.utils.clip_grad, torch.autograd
        import torch.compiler, torch.utils.checkpoint
        spaces = {
            "torch": torch, "torch.nn.functional": torch.nn.functional, "torch.nn.utils": torch.nn.utils,
            "torch.nn.utils.clip_grad": torch.nn.utils.clip_grad, "torch.Tensor": torch.Tensor,
            "torch.nn.Module": torch.nn.Module, "torch.autograd": torch.autograd, "torch.compiler": torch.compiler,
            "torch.utils.checkpoint": torch.utils.checkpoint, "torch.optim.Optimizer": torch.optim.Optimizer,
        }
        before = {k: dict(vars(v)) for k, v in spaces.items()}
        import jmp
        for key, space in spaces.items():
            after = vars(space)
            changed = sorted(n for n in set(before[key]) | set(after) if before[key].get(n) is not after.get(n))
            if changed:
                print(key, ",".join(changed))
        """
    )
    assert done.returncode == 0, done.stderr
    listed = "clip_grad_norm,clip_grad_norm_,clip_grad_value_"
    assert sorted(done.stdout.split("\n")) == sorted(
        ["", "torch compile", f"torch.nn.utils {listed}", f"torch.nn.utils.clip_grad {listed}"]
    ), done.stdout
