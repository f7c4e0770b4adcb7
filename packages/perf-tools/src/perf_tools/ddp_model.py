"""The communication-overhead model of `python -m perf_tools.ddp` (handout 2.3).

An all-reduce of b bytes takes o + b / w (o: per-call overhead,
w: algorithm bandwidth = bytes per rank / time); the tool fits o and w from a quick all-reduce
probe at the start. Let s be the gradient bytes and n_b the number of equal buckets.
* No overlap (NaiveDDP: n_b = number of parameters, FlatDDP: n_b = 1): everything is exposed,
      overhead = n_b * o + s / w.
* Overlap, with the handout's assumption that computing one bucket's gradients takes as long as
  transferring it (s / (n_b w)). Bucket k is ready at k s/(n_b w) and the calls queue behind
  each other, each costing o more than the computation that feeds it, so bucket k finishes at
  (k + 1) s/(n_b w) + k o. After the last gradient (ready at n_b s/(n_b w)) there remains
      overhead(n_b) = s / (n_b w) + n_b o
  (the last bucket's transfer plus the per-call overheads that piled up). Minimizing over n_b:
      n_b* = sqrt(s / (w o)),   optimal bucket size b* = s / n_b* = sqrt(s w o),
      minimum overhead = 2 sqrt(s o / w).
  `model_ms` evaluates this recursion on the wrapper's real bucket sizes (for equal buckets it
  is exactly the formula above).
* `pipeline_ms` drops that assumption: gradients appear at a uniform byte rate over the
  measured backward time T of the no-communication run, and the same queue is simulated. When
  n_b o + s / w < T it approaches o + (last bucket) / w; when communication is the bottleneck
  it approaches n_b o + s / w - T (1 - 1/n_b).
The models leave out what the GPU does besides communicating: copying gradients into buckets,
averaging, and the slowdown of backward kernels that share the GPU with NCCL's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def exposed_comm_s(
    bucket_bytes: Sequence[float], o: float, w: float, *, ready_at: Sequence[float]
) -> float:
    """Time from the last gradient being ready to the last all-reduce finishing.

    Bucket k becomes ready at `ready_at[k]` (seconds, non-decreasing) and its all-reduce takes
    o + bytes_k / w, one after another on the link.
    """
    if len(bucket_bytes) != len(ready_at):
        raise ValueError("bucket_bytes and ready_at must have the same length")
    if not bucket_bytes:
        return 0.0
    finish = 0.0
    for b, r in zip(bucket_bytes, ready_at):
        finish = max(finish, r) + o + b / w
    return finish - ready_at[-1]


def handout_overhead_s(bucket_bytes: Sequence[float], o: float, w: float, overlap: bool) -> float:
    """Exposed time under the handout's assumption (a bucket computes as long as it transfers).

    Without overlap every bucket waits for the end of backward: n_b o + s / w.
    """
    if not overlap:
        return len(bucket_bytes) * o + sum(bucket_bytes) / w
    ready, t = [], 0.0
    for b in bucket_bytes:
        t += b / w
        ready.append(t)
    return exposed_comm_s(bucket_bytes, o, w, ready_at=ready)


def pipeline_overhead_s(
    bucket_bytes: Sequence[float], o: float, w: float, backward_s: float, overlap: bool
) -> float:
    """Exposed time when gradients appear at a uniform byte rate over `backward_s`."""
    if not overlap:
        return len(bucket_bytes) * o + sum(bucket_bytes) / w
    total = sum(bucket_bytes)
    ready, acc = [], 0.0
    for b in bucket_bytes:
        acc += b
        ready.append(backward_s * acc / total if total else backward_s)
    return exposed_comm_s(bucket_bytes, o, w, ready_at=ready)


def optimal_bucket_bytes(s: float, o: float, w: float) -> float:
    """b* = sqrt(s w o): the bucket size minimizing s / (n_b w) + n_b o."""
    return math.sqrt(s * w * o)


def min_overhead_s(s: float, o: float, w: float) -> float:
    """2 sqrt(s o / w): the overhead at the optimal bucket size."""
    return 2.0 * math.sqrt(s * o / w)
