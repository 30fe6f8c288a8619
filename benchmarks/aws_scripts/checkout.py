"""AWS's SMP example scripts, read from a checkout of ``aws/amazon-sagemaker-examples`` given by path.

The scripts are not in this repository (nobody here wrote them). ``--examples DIR`` names a clone
(``git clone https://github.com/aws/amazon-sagemaker-examples DIR``): each benchmark takes its folder at the
commit it was measured on with ``git archive`` (whatever DIR has checked out), or, where DIR is not a git
repository, from DIR's own files at that folder's path. Either way every file a run reads must be the blob
recorded here (git's blob hash: the same bytes), so a result always names the code it ran.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

ORIGIN = "https://github.com/aws/amazon-sagemaker-examples"


@dataclass(frozen=True)
class Scripts:
    """A folder of the origin at a commit, and the blob of every file the runs read (relative to ``folder``)."""

    what: str
    commit: str
    folder: str
    blobs: dict[str, str]


_V1_FILES = {
    "data_pipeline.py": "4a6c3f0c067a172883190a13802b0a7e4a019c80",
    "learning_rates.py": "3939730875d3796a545fdc449602b1177f9b0203",
    "memory_tracker.py": "b91c9241d82a31ccaa0389a7cf203804a4b7ca83",
    "model_config.py": "ae3b40b86c61c50984580773d2ecc02d8a874ea6",
    "sdp_utils.py": "a0033abab9690c6c39d6a9da409902b511ff5835",
}
# the last commit of the main line that has the SMP v1 examples' folder (2024-06-19)
SMP_V1 = Scripts(
    what="AWS's SMP v1 example scripts (gpt2/ and flan-t5/)",
    commit="f2f9985b931eba4bcfb9327fc3c8f522b330b5c0",
    folder="training/distributed_training/pytorch/model_parallel",
    blobs={
        **{f"gpt2/{name}": blob for name, blob in _V1_FILES.items()},
        "gpt2/train.py": "e1d168f2e477f3c485a51279db1a7cc663410355",
        **{f"flan-t5/{name}": blob for name, blob in _V1_FILES.items()},
        "flan-t5/t5_flash_attn.py": "59a7014d646a657eba731f564264572c06c3c2ca",
        "flan-t5/train.py": "c7457ba57f60c4352298ff88171dbf657bd0aa20",
    },
)
# 2025-02-13; the folder last changed in a39b68fa51d7305fa149f10dc0a0f1a83d0c5b92 (2024-10-17). Its name really
# starts with six spaces: that repository orders its top-level folders with leading spaces.
SMP_V2 = Scripts(
    what="AWS's SMP v2 training scripts (shared-scripts/)",
    commit="2d519b52c3a2c2361f2b87f0d3de46fd6c0232a5",
    folder="      build_and_train_models/sm-distributed_model_parallel_v2/shared-scripts",
    blobs={
        "arguments.py": "e261bc66eb8dd73d0133a13de745c60e86410c3b",
        "checkpoints.py": "45d49bf2325c755d267e49fef3f833da34da9b8d",
        "data/__init__.py": "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391",
        "data/dataset/__init__.py": "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391",
        "data/dataset/dummy_dataset.py": "92f1fc6db98cf8559b247df9e7924bc5e3fdeb40",
        "data/dataset/gpt_dataset.py": "69c1d96da3f7a9e2892ea9f5f11fe507f5fab750",
        "data/pipelines/__init__.py": "d4804e287d09bf43babd5711a8ce212a604a1f34",
        "data/pipelines/data_pipeline.py": "f40f60084c8ec306f10eba784d8b50328137993b",
        "data/pipelines/dummy_data_pipeline.py": "9c2634017ee25992f4413eee99a041468e3c75a3",
        "data/pipelines/gpt_data_pipeline.py": "e727947ed35b3cc023fe53ce4a7f226148490078",
        "data/pipelines/hf_data_pipeline.py": "e5d7e2b4968b280b336ced762e79253fa5b1500d",
        "data/utils.py": "79f41a2dccc071677946f1e283005c7e7e786b2e",
        "fsdp_utils.py": "4db1e3ecaaedd47c88071c71e37aa9e7dedf0335",
        "learning_rates.py": "ccdf91dce1c8f26d20803bd67072cdb7379632fa",
        "logging_utils.py": "bbf4c5f8dfce9945b3e6733fcbf4b57c7d3d22ea",
        "memory_tracker.py": "00ca1244514b2299fe8fd8e5907f03bde4482922",
        "requirements.txt": "ba5790f872831e68503ed4410212f5b9ee4c6173",
        "train.py": "e4f1d40a32800b1b687b227c8c328f623d5ddd7a",
        "train_lib.py": "8aa3d041f2e4c6b735b84c0758e2affb114852f9",
        "train_utils.py": "fe56fb1f1c2b1a56d8a832b785715bce8ba174c2",
        "utils.py": "233e118fa2124d533387ac24575cd0e88d6c5594",
    },
)


class CheckoutError(Exception):
    """The checkout given cannot provide the scripts as recorded; the message says why and what to do."""


def how_to_get(benchmark: str, scripts: Scripts, extra: str = "") -> str:
    """What a benchmark prints when no checkout is given: where the scripts come from and how to run it."""
    files = textwrap.fill(", ".join(sorted(scripts.blobs)), 116, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(
        [
            f"{benchmark}: {scripts.what} are not in this repository. They run from a clone",
            f"of {ORIGIN} made outside it, named by path:",
            f"    git clone {ORIGIN} DIR",
            f"    python -m {benchmark} --examples DIR",
            f"It reads, at commit {scripts.commit}, under {scripts.folder!r}:",
            files,
            *([extra] if extra else []),
        ]
    )


def blob_hash(data: bytes) -> str:
    """git's blob hash of ``data`` (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_git_repository(path: Path) -> bool:
    done = subprocess.run(["git", "-C", str(path), "rev-parse", "--git-dir"], capture_output=True, text=True)
    return done.returncode == 0


def _archive(examples: Path, scripts: Scripts, into: Path) -> None:
    """``git archive`` of the files read, at their commit, unpacked under ``into``."""
    paths = [f"{scripts.folder}/{name}" for name in sorted(scripts.blobs)]
    done = subprocess.run(
        ["git", "-C", str(examples), "archive", "--format=tar", scripts.commit, "--", *paths], capture_output=True
    )
    if done.returncode != 0:
        raise CheckoutError(
            f"{examples} has no {scripts.folder!r} at {scripts.commit} ({done.stderr.decode().strip()}); a full "
            f"clone has it (a shallow one: git -C {examples} fetch origin {scripts.commit})"
        )
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(into, filter="data")


def materialise(examples: Path, scripts: Scripts, into: Path) -> Path:
    """The folder of ``scripts`` from the checkout ``examples`` (its commit's files, unpacked under ``into``, or
    the checkout's own files where it is not a git repository), each file read checked against its blob; returns
    the folder."""
    examples = Path(examples).resolve()
    if not examples.is_dir():
        raise CheckoutError(f"{examples} is not a folder")
    if _is_git_repository(examples):
        _archive(examples, scripts, into)
        folder = into / scripts.folder
    else:
        folder = examples / scripts.folder
    wrong = []
    for name, blob in sorted(scripts.blobs.items()):
        path = folder / name
        found = blob_hash(path.read_bytes()) if path.is_file() else "missing"
        if found != blob:
            wrong.append(f"{name}: {found}, recorded {blob}")
    if wrong:
        raise CheckoutError(f"the files under {folder} are not those of {scripts.commit}:\n  " + "\n  ".join(wrong))
    return folder
