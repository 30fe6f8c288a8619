"""The seed documents' scripts run with ``import jmp as smp``."""

import pathlib
import runpy

import numpy as np

SCRIPTS = pathlib.Path(__file__).parent / "seed_scripts"


def test_auto_partition_script_trains():
    namespace = runpy.run_path(str(SCRIPTS / "auto_partition.py"), run_name="seed_script")
    losses = namespace["losses"]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    model = namespace["model"]
    initial = model.module.state_dict()  # the torch module keeps its initial weights
    trained = model.state_dict()
    assert trained.keys() == initial.keys()
    assert all(not np.allclose(trained[k], initial[k]) for k in ("fc1.weight", "conv1.weight"))
