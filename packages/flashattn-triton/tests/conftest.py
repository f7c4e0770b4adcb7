"""Run the Triton kernels in Triton's CPU interpreter where no GPU is present.

``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated; flashattn_triton imports its
kernel module lazily (at the first Triton call), so setting the variable here, before any test
runs, is early enough. CI's nox session sets it too. On a GPU machine nothing is changed.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
