"""Every public name of SMP v1 (``smdistributed.modelparallel.torch``) and SMP v2 (``torch.sagemaker``) that the seed
documents, AWS's example scripts and Hugging Face's ``transformers`` read resolves, under the
launcher's import path, to what SMP has there: ``smp.model.DistributedModel`` is ``smp.DistributedModel``,
``smp.checkpoint`` is the activation-checkpointing function while ``smdistributed.modelparallel.torch.checkpoint`` is
the module of ``save`` / ``load`` / ``save_checkpoint``, ``smp.state.cfg.fp16`` is a bool, ...

``PATHS`` is the list, each entry with where it was taken from; ``smp_paths_probe.py`` resolves it in a fresh
process whose ``PYTHONPATH`` starts with ``jmp/runtime/smp_import_path``, as the launcher's processes'. The last
tests read the installed ``transformers`` and ``accelerate`` again, so a name they start reading fails here until it
is listed (and resolves). AWS's scripts are not in this repository: the benchmarks that run them from a checkout
(``benchmarks/smp_examples.py``, ``benchmarks/smp_v2_examples.py``) check their names against this list with
``reads`` and ``listed`` (``benchmarks/aws_scripts/smp_names.py``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("smp_paths_probe.py")
IMPORT_PATH = ROOT / "jmp" / "runtime" / "smp_import_path"
SMP = "smdistributed.modelparallel.torch"
TSM = "torch.sagemaker"


class SmpPath(NamedTuple):
    form: str  # "attr": read as an attribute chain; "from": `from module import ...`; "absent": must be ImportError
    module: str
    attribute: str
    kind: str  # see smp_paths_probe._kind_error
    source: str
    same: str | None = None  # "module:attribute" of the object it must be

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.attribute}" if self.attribute else self.module


def _attrs(source: str, kind: str, *names: str, module: str = SMP) -> list[SmpPath]:
    return [SmpPath("attr", module, name, kind, source) for name in names]


def _same_as_package(module: str, source: str, kind: str, *names: str) -> list[SmpPath]:
    """``from module import name`` for each name, the same object as ``smp.name``."""
    return [SmpPath("from", f"{SMP}.{module}", name, kind, source, same=f"{SMP}:{name}") for name in names]


SEED_001 = "seed 001 (modifying a PyTorch training script)"
SEED_000 = "seed 000 (activation checkpointing)"
V1_SCRIPTS = "AWS's SMP v1 examples, {gpt2,flan-t5}/train.py"
HF_TRAINER = "transformers trainer.py"
HF_ARGS = "transformers training_args.py"
HF_PT_UTILS = "transformers trainer_pt_utils.py"
HF_MODELING = "transformers modeling_utils.py"
SMP_LAYOUT = "SMP v1's package: the module smp.X lives in"
V2 = "AWS's SMP v2 shared-scripts/"
RANKS = ("rank", "size", "local_rank", "dp_rank", "dp_size", "rdp_rank", "rdp_size", "pp_rank", "pp_size")

PATHS: list[SmpPath] = [
    # --- SMP v1: the package as `import smdistributed.modelparallel.torch as smp` gives it ----------------------
    SmpPath("attr", "smdistributed.modelparallel", "__version__", "version>=1.10", HF_MODELING),
    SmpPath("attr", SMP, "", "module", SEED_001),
    *_attrs(SEED_001, "function", "init", "step", "partition", "get_dp_process_group", "local_rank", "dp_size"),
    *_attrs(SEED_001, "class:torch.nn.Module", "DistributedModel"),
    *_attrs(SEED_001, "function", "DistributedModel.backward", "DistributedModel.forward"),
    *_attrs(SEED_001, "class", "DistributedOptimizer", "amp.GradScaler"),
    *_attrs(SEED_001, "class:torch.optim.Optimizer", "optimizers.FusedAdam", "optimizers.FusedLAMB"),
    *_attrs(SEED_001, "class:torch.optim.Optimizer", "optimizers.FusedNovoGrad"),
    *_attrs(SEED_001, "class:torch.nn.Module", "nn.FusedLayerNorm"),
    *_attrs(SEED_000, "function", "set_activation_checkpointing", "checkpoint", "checkpoint_sequential"),
    SmpPath("from", f"{SMP}.patches.checkpoint", "checkpoint", "function", SEED_000, same=f"{SMP}:checkpoint"),
    SmpPath("from", f"{SMP}.patches.checkpoint", "checkpoint_sequential", "function", SEED_000),
    *_attrs(V1_SCRIPTS, "function", *RANKS, "tp_rank", "tp_size", "barrier", "broadcast", "recv_from"),
    *_attrs(V1_SCRIPTS, "function", "save_checkpoint", "resume_from_checkpoint", "set_partition", "model_creation"),
    *_attrs(V1_SCRIPTS, "function", "get_tp_group", "set_activation_checkpointing"),
    *_attrs(V1_SCRIPTS, "enum", "RankType.PP_RANK", "PP_GROUP"),
    SmpPath("from", f"{SMP}.nn", "FusedLayerNorm", "class:torch.nn.LayerNorm", V1_SCRIPTS),
    SmpPath("attr", SMP, "model.DistributedModel", "class", HF_TRAINER, same=f"{SMP}:DistributedModel"),
    *_attrs(HF_TRAINER, "instance:bool", "state.cfg.fp16", "state.cfg.shard_optimizer_state"),
    *_attrs(HF_ARGS, "instance:bool", "state.cfg.prescaled_batch"),
    *_attrs("SMP v1 config (bf16 beside fp16)", "instance:bool", "state.cfg.bf16"),
    *_attrs(HF_MODELING, "instance:list", "state.module_manager.translate_functions"),
    *_attrs(HF_TRAINER, "function", "barrier", "save", "load", "resume_from_checkpoint", "rank", "rdp_rank"),
    *_attrs(HF_ARGS, "function", "init", "local_rank", "dp_rank", "dp_size", "rdp_rank", "rdp_size", "rank"),
    *_attrs(HF_PT_UTILS, "function", "step", "allgather"),
    *_attrs(HF_PT_UTILS, "enum", "CommGroup.DP_GROUP"),
    SmpPath("attr", SMP, "DP_GROUP", "enum", SMP_LAYOUT, same=f"{SMP}:CommGroup.DP_GROUP"),
    # --- SMP v1: its public submodules, each holding what SMP's does ---------------------------------------------
    SmpPath("from", SMP, "model", "module", SMP_LAYOUT),
    *_same_as_package("model", HF_TRAINER, "class", "DistributedModel"),
    SmpPath("from", f"{SMP}.optimizers", "FusedAdam", "class:torch.optim.Optimizer", SEED_001),
    SmpPath("from", f"{SMP}.amp", "GradScaler", "class", SEED_001, same=f"{SMP}:amp.GradScaler"),
    SmpPath("from", f"{SMP}.state_mod", "state", "instance:object", SMP_LAYOUT, same=f"{SMP}:state"),
    SmpPath("from", f"{SMP}.comm", "CommGroup", "class:enum.Enum", SMP_LAYOUT, same=f"{SMP}:CommGroup"),
    SmpPath("from", f"{SMP}.comm", "RankType", "class:enum.Enum", SMP_LAYOUT, same=f"{SMP}:RankType"),
    *_same_as_package("comm", SMP_LAYOUT, "enum", "WORLD", "DP_GROUP", "MP_GROUP", "PP_GROUP", "TP_GROUP", "RDP_GROUP"),
    *_same_as_package("comm", SMP_LAYOUT, "function", "broadcast", "send", "recv_from", "allgather", "barrier"),
    *_same_as_package("comm", SMP_LAYOUT, "function", "dp_barrier", "rdp_barrier", "tp_barrier", "pp_barrier"),
    *_same_as_package("comm", SMP_LAYOUT, "function", "mp_barrier", "get_dp_process_group", "get_tp_process_group"),
    *_same_as_package("comm", SMP_LAYOUT, "function", "get_pp_process_group", "get_rdp_process_group"),
    *_same_as_package("comm", SMP_LAYOUT, "function", "get_mp_process_group", "get_world_process_group"),
    *_same_as_package("checkpoint", SMP_LAYOUT, "function", "save", "load", "save_checkpoint"),
    *_same_as_package("checkpoint", SMP_LAYOUT, "function", "resume_from_checkpoint"),
    SmpPath("from", f"{SMP}.step", "StepOutput", "class", HF_PT_UTILS + " (StepOutput lives in smp.step)"),
    *_same_as_package("step", SMP_LAYOUT, "function", "step"),
    # --- SMP v2: torch.sagemaker --------------------------------------------------------------------------------
    SmpPath("attr", TSM, "", "module", V2 + "train_lib.py"),
    SmpPath("from", TSM, "init", "function", V2 + "train_lib.py"),
    SmpPath("from", TSM, "transform", "function", V2 + "train_lib.py"),
    SmpPath("from", TSM, "state", "instance:object", V2 + "train_utils.py, checkpoints.py"),
    *_attrs(V2 + "*.py", "instance:int", "state.tensor_parallel_degree", "state.expert_parallel_degree", module=TSM),
    *_attrs(V2 + "*.py", "instance:int", "state.context_parallel_degree", "state.cp_rank", "state.cp_size", module=TSM),
    *_attrs(V2 + "*.py", "instance:int", "state.tp_rank", "state.ep_rank", module=TSM),
    *_attrs(V2 + "train_lib.py", "instance:bool", "state.sm_activation_offloading", module=TSM),
    *_attrs(V2 + "*.py", "instance:torch.distributed.ProcessGroup", "state.tp_process_group", module=TSM),
    *_attrs(V2 + "*.py", "instance:torch.distributed.ProcessGroup", "state.world_process_group", module=TSM),
    *_attrs(V2 + "train_utils.py", "function", "state.get_rng_state_tracker", module=TSM),
    *_attrs(V2 + "checkpoints.py", "function", "state.ranker.get_rep_rank", "state.ranker.get_rep_groups", module=TSM),
    SmpPath("from", f"{TSM}.delayed_param", "DelayedParamIniter", "class", V2 + "train_lib.py"),
    SmpPath("from", f"{TSM}.grad_norm", "clip_grad_norm_", "function", V2 + "train_lib.py"),
    SmpPath("from", f"{TSM}.logger", "get_logger", "function", V2 + "*.py"),
    SmpPath("from", f"{TSM}.moe.moe_config", "MoEConfig", "class", V2 + "train_utils.py"),
    SmpPath(
        "from", f"{TSM}.tensor_parallel.transformer", "TransformerLayer", "class:torch.nn.Module", V2 + "fsdp_utils.py"
    ),
    SmpPath("from", f"{TSM}.utils", "utils", "module", V2 + "train_lib.py"),
    SmpPath("from", f"{TSM}.utils", "utils.timeit", "function", V2 + "train_lib.py"),
    SmpPath("from", f"{TSM}.utils.process_group_utils", "get_global_ranks", "function", V2 + "checkpoints.py"),
    SmpPath("attr", f"{TSM}.checkpoint.utils", "limit_num_subdirs", "function", V2 + "train_lib.py"),
    SmpPath("attr", f"{TSM}.checkpoint.utils", "SORT_BY_LAST_INT", "function", V2 + "train_lib.py"),
    SmpPath("attr", "smdistributed.dataparallel.torch.torch_smddp", "", "module", V2 + "train_lib.py; accelerate"),
    # --- SMP v2 names jmp does not provide: the scripts reach them only where they catch the ImportError, or on
    # a path this environment never takes (each reason below) ---------------------------------------------------
    *[
        SmpPath("absent", f"{TSM}.distributed.checkpoint.{module}", name, "", V2 + "checkpoints.py, train_lib.py")
        # SMP's asynchronous sharded checkpoints on Megatron's: train_lib.py and checkpoints.py import them under
        # `try: ... except ImportError` (train_lib warns, checkpoints.py sets SUPPORT_ASYNC_SAVE = False and its
        # async save and load raise NotImplementedError); only --checkpoint_type async_sharded / async_local reach
        # them (the default is sharded)
        for module, name in (
            ("async_utils", "AsyncCallsQueue"),
            ("state_dict_saver", "PyTorchDistSaveShardedStrategy"),
            ("state_dict_saver", "async_save"),
            ("state_dict_loader", "load"),
            ("state_dict_utils", "sm_state_dict_type"),
            ("state_dict_utils", "SMStateDictType"),
            ("state_dict_utils", "init_optim_state"),
            ("filesystem", "DistributedFileSystemReader"),
        )
    ],
    # use_smp_flash_attn: train_utils.create_model sets it to 0 for transformers >= 4.37.1
    SmpPath("absent", f"{TSM}.nn.attn", "FlashSelfAttention", "", V2 + "train_utils.py"),
    SmpPath("absent", f"{TSM}.nn.huggingface.llama_flashattn", "LlamaFlashAttention", "", V2 + "train_utils.py"),
    # only with --fp8 1 --moe 1 --use_smp_implementation 1 and TransformerEngine's MultiheadAttention
    SmpPath("absent", f"{TSM}.moe.moe_layer", "MoELayer", "", V2 + "train_utils.py"),
    # only on torch < 2.2 (fsdp_utils.get_transformer_layer)
    SmpPath("absent", f"{TSM}.tensor_parallel.transformer", "TETransformerLayer", "", V2 + "fsdp_utils.py"),
]


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> dict[int, str]:
    table = tmp_path_factory.mktemp("smp_paths") / "table.json"
    table.write_text(json.dumps([[p.form, p.module, p.attribute, p.kind, p.same] for p in PATHS]))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(IMPORT_PATH), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(PROBE), str(table)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {int(i): error for i, error in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("index", range(len(PATHS)), ids=[f"{p.form}:{p.dotted}" for p in PATHS])
def test_smp_name_resolves_to_what_smp_has_there(failures, index):
    path = PATHS[index]
    assert index not in failures, f"{path.dotted} ({path.kind}; from {path.source}): {failures[index]}"


# --- the list covers what the scripts and transformers read --------------------------------------------------------

ROOTS = ("smdistributed", "torch.sagemaker")


def aliases_of(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """The names a file binds to SMP's modules and objects (``smp`` -> ``smdistributed.modelparallel.torch``, ``state``
    -> ``torch.sagemaker.state``), and the dotted names its import statements themselves reach."""
    aliases, imported = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ROOTS):
                    imported.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOTS):
            for alias in node.names:
                imported.add(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases, imported


def reads(path: Path) -> set[str]:
    """The dotted SMP names ``path`` reaches: its imports, and each longest attribute chain (``smp.state.cfg.fp16``)
    on a name bound to SMP (comments are not code, so ``# > smp.nn.huggingface...`` is no read)."""
    tree = ast.parse(path.read_text())
    aliases, found = aliases_of(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        names, base = [], node
        while isinstance(base, ast.Attribute):
            names.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            found.add(".".join([aliases[base.id], *names]))
    return {name for name in found if name.startswith(ROOTS) and name != "smdistributed"}


def listed(name: str) -> bool:
    """Whether ``name``, or a longer chain through it (``smp.state`` for ``smp.state.cfg.fp16``), is in ``PATHS``, or
    ``name`` lies under a name listed as absent (``SMStateDictType.SM_LOCAL_STATE_DICT``: its import fails first)."""
    return any(
        path.dotted == name
        or path.dotted.startswith(name + ".")
        or (path.form == "absent" and name.startswith(path.dotted + "."))
        for path in PATHS
    )


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_every_smp_name_the_installed_hugging_face_package_reads_is_listed(package):
    location = Path(pytest.importorskip(package).__file__).parent
    readers = [path for path in location.rglob("*.py") if "smdistributed" in path.read_text(errors="ignore")]
    assert readers  # transformers' trainer and its helpers; accelerate's smddp import
    unlisted = {
        f"{name} ({path.relative_to(location)})" for path in readers for name in reads(path) if not listed(name)
    }
    assert not unlisted, "add to PATHS (and make them resolve):\n" + "\n".join(sorted(unlisted))


def test_the_coverage_check_reads_attribute_chains_and_imports_but_not_comments(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import smdistributed.modelparallel.torch as smp\n"
        "from torch.sagemaker import state\n"
        "if smp.state.cfg.fp16 and state.tp_rank == 0:\n"
        "    smp.DistributedModel(model).module  # smp.nn.huggingface.gpt2 is a comment\n"
    )
    assert reads(script) == {
        SMP,
        f"{TSM}.state",
        f"{SMP}.state.cfg.fp16",
        f"{TSM}.state.tp_rank",
        f"{SMP}.DistributedModel",
    }
    assert listed(f"{SMP}.state.cfg") and not listed(f"{SMP}.state.cfg.fp17")
