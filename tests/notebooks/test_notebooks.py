"""The notebooks in ``notebooks/`` run top to bottom (each ends with a cell asserting what it showed)."""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

UNOPTIMISED = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")  # tests/conftest.py
NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_convert_and_train.ipynb",
        "02_hf_llm_sharded.ipynb",
        "03_pipeline.ipynb",
        "04_memory_tradeoffs.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_kept_without_outputs(path):
    code = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code), (
        f"{path.name} holds outputs: clear them before committing (Jupyter: Edit > Clear Outputs of All Cells)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_checks_pass(path, tmp_path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    # the kernel inherits this process's environment: 8 emulated devices, the session's compilation cache; and
    # XLA's optimised code with its own emitters (the notebooks run and time steps: 04's steps ran 2-3x slower
    # unoptimised; 04 took 118 s under the suite's elemental emitters, 52 s under XLA's own)
    monkeypatch.setenv("XLA_FLAGS", " ".join(f for f in os.environ["XLA_FLAGS"].split() if f not in UNOPTIMISED))
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    images = [o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no figure"
