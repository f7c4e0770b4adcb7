"""What a launch asks of the kernels beyond plain (causal) attention: grouped-query heads,
a sliding window, packed variable-length sequences. ``launch`` turns these into the kernels'
GQA / WINDOW / VARLEN constexpr flags and their integer arguments; a plain call passes
``PLAIN`` (no features: the kernels compile to what they were without them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import resolve_window


class Features(NamedTuple):
    """What a call asks of the kernels beyond plain (causal) attention: ``group`` query heads
    per k/v head, and the kernels' CAUSAL / WINDOW flags with their window bounds (an
    unbounded side of a window is passed as a bound past every key)."""

    group: int
    causal: bool
    window: bool
    left: int
    right: int


def features(
    h: int, h_kv: int, causal: bool, window_left: int, window_right: int, n_q: int, n_k: int
) -> Features:
    """The features of a call with h query heads, h_kv k/v heads and this window (-1:
    unbounded; ``_checks.resolve_window`` normalizes it for Nq queries and Nk keys)."""
    if h_kv < 1 or h % h_kv:
        raise ValueError(
            f"grouped-query attention needs the q heads to be a multiple of the k/v heads, "
            f"got q heads {h} and k/v heads {h_kv}"
        )
    left, right = resolve_window(causal, window_left, window_right, n_q, n_k)
    if left < 0 and right < 0:
        return Features(h // h_kv, False, False, 0, 0)
    if left < 0 and right == 0:
        return Features(h // h_kv, True, False, 0, 0)
    unbounded = n_q + n_k
    return Features(
        h // h_kv, True, True, unbounded if left < 0 else left, unbounded if right < 0 else right
    )


# The feature arguments of a plain call: unused by the kernels, constants to Triton.
PLAIN = {
    "CU_Q": None, "CU_K": None, "kv_group": None, "window_left": None, "window_right": None,
    "GQA": False, "WINDOW": False, "VARLEN": False,
}  # fmt: skip


def feature_args(feat: Features | None, cu_q=None, cu_k=None) -> dict:
    """Kernel arguments for ``feat`` (and varlen offsets), CAUSAL included; {} for a plain
    call (``PLAIN`` goes in as it is)."""
    if feat is None:
        return {}
    return {
        "CU_Q": cu_q, "CU_K": cu_k,
        "kv_group": feat.group if feat.group > 1 else None,
        "window_left": feat.left if feat.window else None,
        "window_right": feat.right if feat.window else None,
        "GQA": feat.group > 1, "WINDOW": feat.window, "VARLEN": cu_q is not None,
        "CAUSAL": feat.causal,
    }  # fmt: skip


class Varlen(NamedTuple):
    """The packing of a varlen call: int32 offsets, number of sequences, longest ones."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    batch: int
    max_q: int
    max_k: int
