"""Shared test settings for perf-tools.

Tests run two pytest-xdist workers on a 2-core machine: one intra-op thread per worker keeps
CPU timings from oversubscribing the cores (which makes tiny ops 100x slower, not wrong).
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
