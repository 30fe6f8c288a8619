"""AWS's SMP v2 training script, vendored unmodified (tests/vendored/smp_v2/shared-scripts), run under ``jmp.launch``.

One configuration here (``llama_hs2_fp32``: two processes, one device each, hybrid shard 2, the notebooks' flags
with a tiny Llama 2, ``--delayed_param 1 --activation_checkpointing 1 --use_smp_implementation 1 --fp8 0``), run
by ``benchmarks/smp_v2_examples.py`` and compared with the same training in plain PyTorch built from the script's
own code. The other configurations (hybrid shard x replicate, tp 2, bf16, offloading, a save and a resume) are the
benchmark's (``python -m benchmarks.smp_v2_examples``; results in ``benchmarks/results/smp_v2_examples.json``).
"""

from __future__ import annotations

import gzip
import json
import subprocess

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the vendored train_lib.py imports accelerate's init_empty_weights")

from benchmarks import smp_v2_examples  # noqa: E402
from benchmarks.script_runs import arg_value  # noqa: E402

NAME = "llama_hs2_fp32"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return smp_v2_examples.make_data(tmp_path_factory.mktemp("smp_v2_data"))


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """The configuration run once (its initial-weights run, then its training), its reference and comparison."""
    record = smp_v2_examples.run_config(NAME, tmp_path_factory.mktemp(NAME), data, timeout_s=600)
    reference = None
    if record["phases"][0]["finished"]:
        reference = smp_v2_examples.run_reference(NAME, data, record["initial_weights"])
    return record, reference


def test_synthetic_data_is_what_the_script_reads_and_the_same_every_time(tmp_path):
    first = smp_v2_examples.make_data(tmp_path / "a")
    second = smp_v2_examples.make_data(tmp_path / "b")
    files = sorted(p.relative_to(first) for p in first.rglob("*.json.gz"))
    assert [str(f) for f in files] == ["test/test_00.json.gz", "train/train_00.json.gz", "train/train_01.json.gz"]
    for f in files:
        assert (first / f).read_bytes() == (second / f).read_bytes()
    with gzip.open(first / files[1], "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == smp_v2_examples.DATA["train_rows"]
    width, vocab = smp_v2_examples.DATA["seq_len"], smp_v2_examples.DATA["vocab"]
    assert all(len(r["input_ids"]) == width and r["attention_mask"] == [1] * width for r in rows)
    assert all(0 <= t < vocab for r in rows for t in r["input_ids"])


def test_the_vendored_scripts_are_as_vendored():
    """Every file under shared-scripts is the blob it was committed as (the origin's, README.md) and unedited."""
    scripts = smp_v2_examples.SCRIPTS
    git = lambda *a: subprocess.run(["git", *a], cwd=scripts, capture_output=True, text=True, check=True).stdout
    assert git("status", "--porcelain", ".") == ""
    for path in git("ls-files", ".").split():
        added = git("log", "--diff-filter=A", "--format=%H", "--", path).split()
        if not added:
            pytest.skip("the clone has no history of the vendored files (shallow)")
        assert git("rev-parse", f"{added[-1]}:./{path}") == git("hash-object", path), path


def test_the_script_runs_unchanged_and_logs_every_step(run):
    record, _ = run
    assert record["ran"], record["first_error"]
    host, script = str(smp_v2_examples.CPU_HOST), str(smp_v2_examples.SCRIPTS / "train.py")
    for phase in record["phases"]:  # jmp.launch ... cpu_host.py shared-scripts/train.py --flags
        assert phase["command"][phase["command"].index(host) + 1] == script
    steps = int(arg_value(smp_v2_examples.CONFIGS[NAME]["phases"][-1], "max_steps"))
    assert list(record["losses"]) == [str(i) for i in range(steps)]
    assert list(record["val_losses"]) == ["1", "3"]  # --validation_freq 2
    # what the CPU host lacked, each said once: no flash_attn, no transformer_engine, no datasets, no CUDA
    notes = " ".join(record["harness"])
    for lacking in ("flash_attention_2", "transformer_engine", "datasets", "torch.cuda.device_count"):
        assert lacking in notes, record["harness"]


def test_logged_losses_track_pytorch(run):
    record, reference = run
    assert record["ran"], record["first_error"]
    comparison = smp_v2_examples.compare(record, reference)
    assert comparison["within_tolerance"], comparison
    assert reference["losses_rank0"][-1] < reference["losses_rank0"][0]  # it trains


def test_the_cpu_hosts_stand_ins_cover_only_the_paths_that_do_not_need_the_real_package():
    import sys

    sys.path.insert(0, str(smp_v2_examples.EXAMPLES))
    try:
        import cpu_host
    finally:
        sys.path.remove(str(smp_v2_examples.EXAMPLES))
    engine = cpu_host.STAND_INS["transformer_engine"][0]()
    with engine["transformer_engine.pytorch"].fp8_autocast(enabled=False):  # --fp8 0
        pass
    recipe = engine["transformer_engine.common.recipe"]
    delayed = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    assert (delayed.fp8_format, delayed.amax_history_len, delayed.margin) == (recipe.Format.HYBRID, 16, 0)
    from jmp.precision.fp8_autocast import requested

    with engine["transformer_engine.pytorch"].fp8_autocast(enabled=True, fp8_recipe=delayed):  # --fp8 1: jmp's fp8
        assert (requested().fp8_format, requested().amax_history_len) == ("hybrid", 16)
    assert requested() is None
    with pytest.raises(NotImplementedError, match="not called under jmp"):
        engine["transformer_engine.pytorch"].checkpoint(lambda x: x, 1)
    with pytest.raises(NotImplementedError, match="--dataset_type hf needs Hugging Face's datasets"):
        cpu_host.STAND_INS["datasets"][0]()["datasets"].load_from_disk("/data")
