"""The seed documents' scripts run with ``import jmp as smp``."""

import pathlib
import runpy

import numpy as np

SCRIPTS = pathlib.Path(__file__).parent / "seed_scripts"


def optimizer_steps(namespace: dict) -> int:
    """How many updates the script's optimizer made (torch's step count in its state)."""
    state = namespace["optimizer"].state_dict()["state"]
    return int(next(iter(state.values()))["step"])


def test_auto_partition_script_trains():
    namespace = runpy.run_path(str(SCRIPTS / "auto_partition.py"), run_name="seed_script")
    losses = namespace["losses"]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    model = namespace["model"]
    module_state = model.module.state_dict()  # the torch module holds the trained weights when read
    trained = model.state_dict()
    assert trained.keys() == module_state.keys()
    assert all(np.array_equal(trained[k], module_state[k]) for k in trained)
    assert optimizer_steps(namespace) == 3


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
    module_state = model.module.state_dict()
    trained = model.state_dict()
    assert all(np.array_equal(trained[k], module_state[k]) for k in trained)
    assert optimizer_steps(namespace) == 3
