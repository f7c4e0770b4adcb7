"""Skip hardware-marked tests, with a reason, where the hardware is missing.

`gpu` tests need one CUDA device; `nccl` tests need two and a torch built with NCCL. Both run
under `nox -s gpu_tests` / `nox -s nccl_tests` on the GPU machine and skip everywhere else.
"""

from __future__ import annotations

import pytest


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_ok() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_nccl_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpus = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `nox -s gpu_tests` on a GPU machine")
    skip_nccl = pytest.mark.skip(
        reason=f"needs 2 CUDA GPUs and NCCL (found {n_gpus}): run `nox -s nccl_tests`"
    )
    for item in items:
        if "nccl" in item.keywords and (n_gpus < 2 or not _nccl_ok()):
            item.add_marker(skip_nccl)
        elif "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
