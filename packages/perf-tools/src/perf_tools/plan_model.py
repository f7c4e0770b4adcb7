"""Closed-form step time and memory of DP, FSDP, TP and FSDP x TP training (`perf_tools.plan`).

The handout's analysis (CS336 systems, "4D parallelism" / `communication_accounting`, after the
TPU Scaling Book part 5), extended from its FFN-only model to lm_core's Transformer. N devices
of C FLOP/s each train on a global batch of G tokens; ring collectives over n ranks of a tensor
of S bytes (the full, gathered size) on links of W bytes/s one way per device take

    all-gather(S, n) = reduce-scatter(S, n) = (n - 1)/n * S / W      (n - 1 steps of S/n)
    all-reduce(S, n) = 2 (n - 1)/n * S / W                           (reduce-scatter + all-gather)

Per step (P parameters, b = 2 bytes per communicated value, bf16; D width, L blocks):

    compute   = 6 P_mm G (+ attention) / (N C)  the model's step FLOPs, `perf_tools.flops`
    DP        all-reduce(P b, N)                   gradients
    FSDP      2 all-gather(P b, N) + reduce-scatter(P b, N)
                                                   weights gathered in forward and again in
                                                   backward, gradients reduce-scattered
    TP        a all-reduce(G D b, N) per block     activations; a = 4 (attention output and
                                                   FFN output in forward, the gradients of both
                                                   blocks' inputs in backward), a = 2 for the
                                                   handout's FFN-only blocks (one all-reduce per
                                                   FFN and pass); q/k/v and w1/w3 are
                                                   column-parallel, the output projection and w2
                                                   row-parallel, so nothing else moves
    FSDP x TP on an N_TP x N_FSDP grid (TP groups of consecutive ranks):
              FSDP terms with P / N_TP bytes over N_FSDP ranks
            + TP terms with G / N_FSDP tokens over N_TP ranks

The handout's two cases: communication overlapped with compute (step = max(compute, comm)) or
not (step = compute + comm); the configuration is compute-bound when comm <= compute. A group
that fits in one node (n ranks, or the span of a strided FSDP group, <= GPUs per node) uses the
intra-node bandwidth (NVLink), else the inter-node one (the NIC per GPU).

Memory per device (bytes): fp32 master weights, fp32 gradients, AdamW's two fp32 moments, each
P / (sharding degree) (DP: 1, every other strategy: N; the norms are counted as sharded too), and
the activations saved for backward in bf16, from `perf_tools.accounting`'s per-token count of
lm_core's block: 10 D + 4 F values per token and block, of which 4 D (the two norm inputs and
the two sharded matmuls' inputs) stay whole under TP and 6 D + 4 F (q, k, v, rotated q and k,
attention output, the SwiGLU's four F-wide tensors) split N_TP ways; plus the fused attention's
fp32 log-sum-exp (H values per token and block, split by heads) and after the blocks 2 D + V
(logits split by vocabulary). With activation checkpointing of every block: the L block inputs
(D each), one block's activations rebuilt in backward and the head; it costs one more forward
(compute x 4/3). Transient buffers (FSDP's gathered layer, communication buffers, the allocator)
are not counted: a configuration fits when the rest takes at most `Hardware.usable` (90%) of
the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from perf_tools import accounting, flops
from perf_tools.accounting import GB, Dtypes, ModelDims

STRATEGIES = ("dp", "fsdp", "tp", "fsdp x tp")
CKPT_COMPUTE = 4.0 / 3.0  # a checkpointed step runs the forward twice: 4 F_fwd instead of 3


@dataclass(frozen=True)
class Hardware:
    """One GPU kind: dense bf16 FLOP/s, memory (bytes), one-way bandwidth per GPU (bytes/s)
    inside a node and across nodes, GPUs per node; a plan fits when the counted bytes are at
    most `usable` of the memory (the rest: CUDA context, communication buffers, FSDP's
    gathered layer, allocator fragmentation)."""

    name: str
    flops: float
    memory: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    usable: float = 0.9

    def bandwidth(self, span: int) -> float:
        """W of a collective whose ranks span `span` consecutive GPUs."""
        return self.intra_bw if span <= self.gpus_per_node else self.inter_bw


# Datasheet numbers, dense bf16. Intra-node: NVLink one way (half the bidirectional figure);
# A100 PCIe: PCIe 4.0 x16. Inter-node: one 400 Gb/s NIC per GPU (200 Gb/s for the A100s).
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware("H100 SXM", 989.4e12, 80e9, 450e9, 50e9),
    "H200": Hardware("H200 SXM", 989.4e12, 141e9, 450e9, 50e9),
    "A100": Hardware("A100 SXM", 312e12, 80e9, 300e9, 25e9),
    "A100-PCIe": Hardware("A100 PCIe", 312e12, 80e9, 32e9, 25e9),
    "B200": Hardware("B200", 2250e12, 180e9, 900e9, 50e9),
}

# A 70B-class model with Llama-3-70B's dimensions (lm_core blocks: multi-head attention, so
# 79.9B parameters rather than 70.6B with grouped-query attention).
LLAMA70B = ModelDims("70B", d_model=8192, d_ff=28672, num_layers=80, vocab_size=128_256,
                     num_heads=64)  # fmt: skip


def model_preset(name: str) -> tuple[ModelDims, int]:
    """(dims, default sequence length): an lm_core preset, 'xxl' (the handout's) or '70B'."""
    if name == "70B":
        return LLAMA70B, 8192
    dims = accounting.preset(name)
    if dims.ffn_only:
        return dims, 2048
    from lm_core import MODEL_SIZES

    return dims, MODEL_SIZES[name].context_length


# ------------------------------------------------------------------ collectives (closed form)
def all_gather_time(nbytes: float, n: int, bw: float) -> float:
    """Ring all-gather of a tensor of `nbytes` (gathered size) over n ranks: (n-1)/n S/W."""
    return (n - 1) / n * nbytes / bw if n > 1 else 0.0


def reduce_scatter_time(nbytes: float, n: int, bw: float) -> float:
    """Ring reduce-scatter of `nbytes` (input size) over n ranks: (n-1)/n S/W."""
    return all_gather_time(nbytes, n, bw)


def all_reduce_time(nbytes: float, n: int, bw: float) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2 (n-1)/n S/W."""
    return 2 * all_gather_time(nbytes, n, bw)


# ------------------------------------------------------------------ workload and layouts
@dataclass(frozen=True)
class Workload:
    """What is trained: the model, G tokens per step in sequences of `seq`, the dtypes."""

    model: ModelDims
    global_tokens: int
    seq: int
    dtypes: Dtypes = field(default_factory=Dtypes)

    @property
    def params(self) -> int:
        return accounting.param_count(self.model)

    @property
    def sequences(self) -> float:
        return self.global_tokens / self.seq

    def step_flops(self) -> float:
        """Matmul FLOPs of a training step on the global batch (3x the forward)."""
        m = self.model
        if m.ffn_only:  # blocks of two linears: 2 FLOPs per MAC, D x F twice
            return 3 * 2 * self.global_tokens * m.num_layers * 2 * m.d_model * m.d_ff
        return 3 * flops.formula_forward_flops(m, self.sequences, self.seq)

    def tp_allreduces_per_block(self) -> int:
        return 2 if self.model.ffn_only else 4


@dataclass(frozen=True)
class Layout:
    """`dp` data-parallel groups (replicas for DP, shards for FSDP) x `tp` tensor-parallel ranks."""

    strategy: str
    dp: int
    tp: int

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def label(self) -> str:
        return f"{self.dp}x{self.tp}" if self.strategy == "fsdp x tp" else str(self.devices)


def invalid_reason(layout: Layout, work: Workload) -> str | None:
    """Why `layout` cannot run `work` (None if it can): TP must split heads and d_ff; every
    data-parallel group needs at least one whole sequence."""
    m = work.model
    if layout.tp > 1 and (m.d_ff % layout.tp or (not m.ffn_only and m.num_heads % layout.tp)):
        return f"tp={layout.tp} does not divide heads ({m.num_heads}) and d_ff ({m.d_ff})"
    if layout.dp > work.sequences:
        return f"{work.sequences:g} sequences < {layout.dp} data-parallel groups"
    return None


def layouts(n: int, work: Workload) -> list[Layout]:
    """Every strategy at N devices: DP, FSDP, TP and each 2-D factorization N_FSDP x N_TP
    with both factors > 1."""
    out = [Layout("dp", n, 1), Layout("fsdp", n, 1), Layout("tp", 1, n)]
    out += [Layout("fsdp x tp", n // t, t) for t in range(2, n) if n % t == 0]
    return out


# ------------------------------------------------------------------ costs
def comm_terms(
    layout: Layout, work: Workload, hw: Hardware, micro_steps: int = 1
) -> dict[str, float]:
    """Seconds per step of each collective family (module docstring). With gradient
    accumulation over `micro_steps`, FSDP gathers the weights and reduce-scatters the
    gradients in every micro-step (torch's default); DP all-reduces once per step (no_sync);
    TP moves the same activations in total."""
    p_bytes = work.params * work.dtypes.comm
    m, n = work.model, layout.devices
    terms = {"grad_allreduce": 0.0, "weight_allgather": 0.0, "grad_reducescatter": 0.0}
    terms["tp_allreduce"] = 0.0
    if layout.strategy == "dp":
        terms["grad_allreduce"] = all_reduce_time(p_bytes, n, hw.bandwidth(n))
        return terms
    if layout.dp > 1:  # FSDP over dp ranks of stride tp: its groups span all N devices
        shard_bytes = p_bytes / layout.tp
        bw = hw.bandwidth(n)
        terms["weight_allgather"] = micro_steps * 2 * all_gather_time(shard_bytes, layout.dp, bw)
        terms["grad_reducescatter"] = micro_steps * reduce_scatter_time(shard_bytes, layout.dp, bw)
    if layout.tp > 1:
        act_bytes = work.global_tokens / layout.dp * m.d_model * work.dtypes.activation
        count = work.tp_allreduces_per_block() * m.num_layers
        bw = hw.bandwidth(layout.tp)
        terms["tp_allreduce"] = count * all_reduce_time(act_bytes, layout.tp, bw)
    return terms


def activation_bytes(work: Workload, tokens: float, tp: int, checkpointed: bool) -> float:
    """bf16 activations saved for backward on one device holding `tokens` tokens, split `tp`
    ways as the module docstring says (plus the fp32 log-sum-exp of fused attention)."""
    m, b = work.model, work.dtypes.activation
    d, f = m.d_model, m.d_ff
    if m.ffn_only:  # each linear keeps its input: D (whole under TP) and F (split)
        block = (d + f / tp) * b
        head = 0.0
    else:
        block = (4 * d + (6 * d + 4 * f) / tp) * b + 4 * m.num_heads / tp
        head = (2 * d + m.vocab_size / tp) * b
    if checkpointed:
        per_token = m.num_layers * d * b + block + head
    else:
        per_token = m.num_layers * block + head
    return tokens * per_token


def _micro_batches(sequences: float, micro_batch: int | None) -> list[int]:
    """Candidate sequences per micro-step: `micro_batch` if given, else all of a group's
    sequences, then halving down to 1."""
    whole = max(1, math.floor(sequences))
    if micro_batch is not None:
        return [min(micro_batch, whole)]
    out = [whole]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def predict(
    layout: Layout, work: Workload, hw: Hardware, micro_batch: int, ckpt: bool
) -> dict[str, Any]:
    """One configuration's predicted row: `micro_batch` sequences per data-parallel group and
    micro-step, activation checkpointing of every block or none (`evaluate` picks them)."""
    n = layout.devices
    sequences = work.sequences / layout.dp
    micro_steps = math.ceil(sequences / micro_batch - 1e-9)
    compute = work.step_flops() / (n * hw.flops) * (CKPT_COMPUTE if ckpt else 1.0)
    terms = comm_terms(layout, work, hw, micro_steps)
    comm = sum(terms.values())
    shard = 1 if layout.strategy == "dp" else n
    dt = work.dtypes
    weights = work.params * dt.master / shard
    grads = work.params * dt.grad / shard
    optim = work.params * dt.optim_state * dt.optim_values / shard
    tokens = micro_batch * work.seq
    act = activation_bytes(work, tokens, layout.tp, checkpointed=False)
    act_ckpt = activation_bytes(work, tokens, layout.tp, checkpointed=True)
    total = weights + grads + optim + (act_ckpt if ckpt else act)
    return {
        "N": n,
        "strategy": layout.strategy,
        "grid": layout.label,
        "n_fsdp": layout.dp if layout.strategy != "dp" else 1,
        "n_tp": layout.tp,
        "seqs_per_group": sequences,
        "micro_batch": micro_batch,
        "micro_steps": micro_steps,
        "ckpt": ckpt,
        "compute_ms": compute * 1e3,
        "comm_ms": comm * 1e3,
        **{f"{k}_ms": v * 1e3 for k, v in terms.items()},
        "step_overlap_ms": max(compute, comm) * 1e3,
        "step_serial_ms": (compute + comm) * 1e3,
        "comm_over_compute": comm / compute,
        "bound": "compute" if comm <= compute else "comm",
        "weights_GB": weights / GB,
        "grads_GB": grads / GB,
        "optim_GB": optim / GB,
        "act_GB": act / GB,
        "act_ckpt_GB": act_ckpt / GB,
        "total_GB": total / GB,
        "fits": total <= hw.usable * hw.memory,
    }


def evaluate(
    layout: Layout, work: Workload, hw: Hardware, micro_batch: int | None = None
) -> dict[str, Any]:
    """One row of the plan: times (ms; compute includes checkpointing's recompute), memory
    (GB per device), boundness, fit. Among micro-batch sizes (sequences per data-parallel group
    and micro-step; `micro_batch` fixes it) with and without activation checkpointing, the
    fastest overlapped step that fits; when none fits, the smallest-memory one (fits False)."""
    options = [
        predict(layout, work, hw, mb, ckpt)
        for mb in _micro_batches(work.sequences / layout.dp, micro_batch)
        for ckpt in (False, True)
    ]
    fitting = [r for r in options if r["fits"]]
    if fitting:
        return min(fitting, key=lambda r: (r["step_overlap_ms"], r["step_serial_ms"]))
    return min(options, key=lambda r: r["total_GB"])


def plan_rows(
    devices: list[int], work: Workload, hw: Hardware, micro_batch: int | None = None
) -> list[dict[str, Any]]:
    """Every valid layout at every N, with the recommended one per N marked: the shortest
    overlapped step (checkpointing's recompute included) among those that fit in memory."""
    rows = []
    for n in devices:
        at_n = []
        for layout in layouts(n, work):
            if invalid_reason(layout, work) is None:
                at_n.append(evaluate(layout, work, hw, micro_batch))
        fitting = [r for r in at_n if r["fits"]]
        best = min(fitting, key=lambda r: (r["step_overlap_ms"], r["comm_ms"]), default=None)
        for r in at_n:
            r["recommended"] = r is best
        rows.extend(at_n)
    return rows


# ------------------------------------------------------------------ thresholds
def _last_true(pred: Any, lo: int, hi: int) -> int:
    """Largest k in [lo, hi] with pred(k), for pred true at lo and monotone (true then false)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _compute_bound(layout: Layout, work: Workload, hw: Hardware) -> bool:
    return sum(comm_terms(layout, work, hw).values()) <= work.step_flops() / (
        layout.devices * hw.flops
    )


def max_compute_bound(strategy: str, work: Workload, hw: Hardware) -> dict[str, Any]:
    """The largest N at which `strategy` is still compute-bound, and what stops it there.

    For a fixed global batch comm / compute grows with N for every strategy ((N-1) factors,
    and slower links once a group leaves the node), so a binary search over N finds it; N is
    also capped by the batch (one sequence per data-parallel group) and, for TP, by the heads
    (and d_ff) it must divide. FSDP x TP: the best N_TP x (largest compute-bound N_FSDP).
    """
    m = work.model
    batch_cap = max(1, int(work.sequences))
    heads = m.d_ff if m.ffn_only else math.gcd(m.num_heads, m.d_ff)
    tp_degrees = [t for t in range(1, heads + 1) if heads % t == 0]
    if strategy in ("dp", "fsdp"):
        n = _last_true(lambda k: _compute_bound(Layout(strategy, k, 1), work, hw), 1, batch_cap)
        limit = "batch" if n == batch_cap else "comm"
        return {"strategy": strategy, "max_N": n, "grid": str(n), "limited_by": limit}
    if strategy == "tp":
        ok = [t for t in tp_degrees if _compute_bound(Layout("tp", 1, t), work, hw)]
        n = max(ok)
        limit = "heads" if n == tp_degrees[-1] else "comm"
        return {"strategy": strategy, "max_N": n, "grid": str(n), "limited_by": limit}
    best = {"strategy": strategy, "max_N": 1, "grid": "1x1", "limited_by": "comm"}
    for t in tp_degrees[1:]:
        if not _compute_bound(Layout(strategy, 1, t), work, hw):
            continue
        f = _last_true(
            lambda k, t=t: _compute_bound(Layout(strategy, k, t), work, hw), 1, batch_cap
        )
        if f * t > best["max_N"]:
            limit = "batch" if f == batch_cap else "comm"
            best = {"strategy": strategy, "max_N": f * t, "grid": f"{f}x{t}", "limited_by": limit}
    return best
