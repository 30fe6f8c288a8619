"""Every SMP name (``smdistributed.modelparallel.torch.*``, ``torch.sagemaker.*``) AWS's scripts read is listed in
``tests/runtime/test_smp_module_paths.py``'s ``PATHS``, whose test checks that each resolves to what SMP has there.
The suite cannot read the scripts (they are not in this repository), so each benchmark that runs them checks its
checkout's files first; a name it reports belongs in ``PATHS``."""

from __future__ import annotations

from pathlib import Path

from tests.runtime.test_smp_module_paths import listed, reads


def unlisted(files: list[Path], root: Path) -> list[str]:
    """``name (file)`` for each SMP name ``files`` read that ``PATHS`` does not list (file relative to ``root``)."""
    return sorted({f"{name} ({path.relative_to(root)})" for path in files for name in reads(path) if not listed(name)})


def status_line(names: list[str]) -> str:
    if not names:
        return "SMP names the scripts read: every one is listed in tests/runtime/test_smp_module_paths.py"
    listing = "\n  ".join(names)
    return f"SMP names the scripts read that tests/runtime/test_smp_module_paths.py lacks (add to PATHS):\n  {listing}"
