"""Assign parameters to ranks so that every rank owns about the same number of elements.

Greedy largest-first (the LPT rule): within a parameter group, visit tensors from the largest
to the smallest (ties in list order) and give each to the rank that currently owns the fewest
elements (ties to the lowest rank). Loads carry over from earlier groups, so a group added later
(e.g. unfrozen layers) fills the lightest ranks without moving anything already assigned; moving
a parameter would mean moving its optimizer state.

Why greedy and not a contiguous split: our parameter sync broadcasts each owner's parameters
(large tensors in place, small ones packed into buckets), so a rank's shard need not be a
contiguous slice of one flat buffer. Freed from contiguity, greedy balances much better when
tensor sizes differ a lot (a 16M-element embedding beside 2.5M-element attention matrices and
1.6K-element norms): its largest load is at most 4/3 of the optimum, and never more than the
optimum plus the largest single tensor. The result is a pure function of the sizes and their
order, so every rank computes the same assignment without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence


def greedy_partition(numels: Sequence[int], loads: list[int]) -> list[int]:
    """The owner rank of each tensor of one group; updates `loads` (elements per rank) in place.

    `numels[i]` is the element count of the group's i-th tensor; `len(loads)` is the world size.
    """
    if not loads:
        raise ValueError("loads: expected one entry per rank (world size >= 1), got []")
    owners = [0] * len(numels)
    order = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
    for i in order:
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += numels[i]
    return owners
