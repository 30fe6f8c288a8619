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
