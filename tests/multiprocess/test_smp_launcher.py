"""``python -m jmp.launch`` as SageMaker's launcher: an SMP v1 script runs with no edit, one process per device;
SMP's process groups carry ``torch.distributed`` collectives; jmp's notices print once per job and gloo's
connection lines not at all.

One launch of ``smp_script.py`` (2 processes x 1 CPU device) serves the tests that read its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jmp.launch import pass_on_output
from tests.multiprocess.reports import json_objects

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multiprocess/smp_script.py"
ENV = os.environ | {"PYTHONPATH": str(ROOT), "JMP_HEARTBEAT_TIMEOUT": "30"}
LAUNCHER_ALONE = [sys.executable, "-c", "import runpy; runpy.run_path('jmp/launch.py', run_name='__main__')"]
MP_PARAMETERS = {"partitions": 1, "ddp": True}


@pytest.fixture(scope="module")
def launched() -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--mp-parameters", json.dumps(MP_PARAMETERS)]
    command += [SCRIPT, "smp", "--epochs", "3", "--model", "tiny"]
    env = {k: v for k, v in ENV.items() if k not in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS")}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reports(launched) -> dict[int, dict]:
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-5000:]
    found = {r["rank"]: r for r in json_objects(launched.stdout) if "rank" in r}
    assert sorted(found) == [0, 1], launched.stdout
    return found


def test_smp_imports_resolve_to_jmp_and_tools_see_smp_enabled(reports):
    for report in reports.values():
        assert report["smp_is_jmp"] and report["version"] == "1.15.0"
        assert report["sagemaker_mp_enabled"]  # transformers.utils.import_utils.is_sagemaker_mp_enabled()
        assert report["framework_params"]["sagemaker_mpi_enabled"] is True
        assert report["hyperparameters"] == ["--epochs", "3", "--model", "tiny"]
        assert report["cfg"] == {"partitions": 1, "microbatches": 1, "ddp": True}  # from --mp-parameters


def test_torch_distributed_runs_over_smps_process_groups(reports):
    for me, report in reports.items():
        assert report["torch_ranks"] == [me, 2, me, 2]  # torch.distributed's rank and size are smp's
        assert report["state_ranks"] == [me, me, 2]  # smp.state.rank, dp_rank, dp_size
        own = {"sum": [me + 1.0, 10.0 * (me + 1)], "gathered": [float(me)], "broadcast": float(me)}
        both = {"sum": [1.0 + 2.0, 10.0 + 20.0], "gathered": [0.0, 1.0], "broadcast": 0.0}
        # one device per process, data parallel: dp holds both processes, each holds its whole model
        data_parallel = report["data_parallel"]
        for name, expected in {"world": both, "dp": both, "rdp": both, "mp": own, "pp": own, "tp": own}.items():
            assert {k: data_parallel[name][k] for k in expected} == expected, name
        assert data_parallel["lists"] == {"dp": [0, 1], "rdp": [0, 1], "mp": [me], "pp": [me], "tp": [me]}
        # pipeline_parallel_degree 2: process i holds stage i
        pipelined = report["pipelined"]
        for name, expected in {"world": both, "dp": own, "rdp": own, "mp": both, "pp": both, "tp": own}.items():
            assert {k: pipelined[name][k] for k in expected} == expected, name
        assert pipelined["lists"] == {"dp": [me], "rdp": [me], "mp": [0, 1], "pp": [0, 1], "tp": [me]}


def test_each_process_passes_its_own_batch_and_the_update_is_the_global_batchs(reports):
    """SMP's semantics under one process per device: ``train_step(model, 4 rows)`` on each of 2 processes is one
    step on 8 rows (the gradient averaged over data-parallel ranks), as PyTorch computes it on all 8."""
    torch.manual_seed(0)
    data, target = torch.randn(8, 3), torch.randn(8, 2)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(model(data), target).backward()
    optimizer.step()
    for report in reports.values():
        for name, value in model.state_dict().items():
            torch.testing.assert_close(torch.tensor(report["step"]["state"][name]), value, rtol=1e-5, atol=1e-6)


def _sgd_step_on(rows: slice) -> dict[str, torch.Tensor]:
    """PyTorch's one SGD step on ``rows`` of the 8 rows the script generates: the weights after it."""
    torch.manual_seed(0)
    data, target = torch.randn(8, 3), torch.randn(8, 2)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(model(data[rows]), target[rows]).backward()
    optimizer.step()
    return model.state_dict()


def test_tensor_parallel_ranks_pass_their_own_rows_unless_the_batch_is_prescaled(reports):
    """At tp 2 over the two processes, without ``prescaled_batch`` each tp rank passes its own 4 rows and the step
    is over all 8 (SMP: each tp rank loads its own batch, the tp group computes on them all); with it the tp group
    reads one batch (AWS's GPT-2 script shards the data by ``rdp_rank`` of ``rdp_size``, 1 here) and the step is
    over those 4 rows once."""
    for key, shares, rows in (("tp2_step", 2, slice(0, 8)), ("tp2_prescaled_step", 1, slice(0, 4))):
        expected = _sgd_step_on(rows)
        for me, report in reports.items():
            assert report[key]["share"] == [me if shares == 2 else 0, shares], key
            for name, value in expected.items():
                torch.testing.assert_close(torch.tensor(report[key]["state"][name]), value, rtol=1e-5, atol=1e-6)


def test_jmps_notices_print_once_per_job_and_gloos_connection_lines_not_at_all(launched, reports):
    output = launched.stdout + launched.stderr
    assert output.count("config key 'ddp' has no effect in jmp") == 1, output[-5000:]
    assert output.count("smp.init(): the config comes from SM_HP_MP_PARAMETERS") == 1
    assert "[Gloo]" not in output


def test_the_aliases_can_be_turned_off():
    command = [*LAUNCHER_ALONE, "-n", "2", "--no-smp-aliases", SCRIPT, "find-spec"]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [r["found"] for r in json_objects(result.stdout)] == [False, False]


def test_output_passes_through_less_gloos_connection_lines():
    written = (
        b"epoch 1 [####....]\r"
        b"[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
        b"loss 0.5\n[Gloo] Rank 3 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
        b"[Gloo] is what the user printed\npartial"
    )
    source, sink = os.pipe(), os.pipe()
    os.write(source[1], written)
    os.close(source[1])
    pass_on_output(source[0], sink[1])
    os.close(sink[1])
    with os.fdopen(sink[0], "rb") as received:
        # a gloo line after a carriage return is still mid-line (the progress bar's): kept as written
        assert received.read() == written.replace(
            b"loss 0.5\n[Gloo] Rank 3 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
            b"loss 0.5\n",
        )


def test_one_process_driving_every_device_computes_a_small_batch_whole_and_says_how_to_launch_one_per_device(
    monkeypatch, caplog
):
    """The gpt2 script's ``--train_batch_size 4`` in one process over 8 devices: it runs, each device computing the
    whole batch, and the notice explains the difference from SMP's per-process batch and names the launch that
    keeps it."""
    import jmp as smp
    from jmp.runtime import notices

    monkeypatch.setattr(notices, "_SAID", set())
    caplog.set_level("INFO", logger="jmp")
    smp.init({})
    module = torch.nn.Linear(3, 2)
    model = smp.DistributedModel(module)

    @smp.step
    def forward(model, data):
        return model(data)

    data = torch.randn(4, 3)
    torch.testing.assert_close(forward(model, data).concat(), module(data).detach())
    assert "batch of 4 rows does not divide into 1 microbatches x 8 data-parallel shards" in caplog.text
    assert "batch size is per process" in caplog.text and "python -m jmp.launch -n 8 script.py" in caplog.text


def test_an_uncaught_error_after_smp_init_shows_its_traceback(tmp_path):
    """torch.distributed's excepthook buffers the traceback until the hook it wraps returns; jmp's, which ends
    the process at once, must run outside it or the traceback never reaches the launcher's output."""
    script = tmp_path / "fails.py"
    script.write_text("import jmp as smp\nsmp.init({})\nraise RuntimeError('boom from the script')\n")
    command = [sys.executable, "-m", "jmp.launch", "-n", "2", "--cpu-devices", "1", str(script)]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "RuntimeError: boom from the script" in done.stderr, done.stderr[-3000:]
    assert "Traceback" in done.stderr
