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


def test_manual_partition_script_trains_on_its_stages():
    namespace = runpy.run_path(str(SCRIPTS / "manual_partition.py"), run_name="seed_script")
    losses = namespace["losses"]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    model = namespace["model"]
    stages = model.pipeline.layout.stages
    assert {n: stages[n] for n in ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight")} == {
        "conv1.weight": (0,),
        "conv2.weight": (0,),
        "fc1.weight": (1,),
        "fc2.weight": (1,),
    }
    initial = model.module.state_dict()
    trained = model.state_dict()
    assert all(not np.allclose(trained[k], initial[k]) for k in ("fc2.weight", "conv1.weight"))
