"""Which attention backends can run in this test environment (shared by tests and conftest)."""

from __future__ import annotations

import os

import torch

from lm_core import available_backends


def runnable_backends() -> list[str]:
    """Attention backends importable here; flash-triton on CPU only under TRITON_INTERPRET=1."""
    names = available_backends()
    if "flash-triton" in names and not (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        names.remove("flash-triton")
    return names
