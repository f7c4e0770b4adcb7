"""Memory and communication accounting (handout 2.4 `communication_accounting`, section 3):
`python -m perf_tools.accounting`.

For a model (lm_core presets, the handout's XXL, or custom dims) and dtypes it prints:

1. Memory on one device: master weights, accumulated gradients, optimizer state (AdamW keeps
   two values per parameter), activations saved for backward, and how many devices of a
   given memory that is.
2. Per-device memory under N-way FSDP, with weights, gradients, optimizer state and half of
   the activations sharded (handout (b), "every second layer"):
       mem(N) = (W + G + O + A/2) / N + A/2
   and the smallest N with mem(N) <= device memory (for each --device-memory-gb).
3. Communication per step and device for N-way data parallelism: DDP (all-reduce gradients:
   2(N-1)/N G), ZeRO stage 1 (reduce-scatter gradients + all-gather parameters:
   (N-1)/N (G + P)), this repo's zero_shard (DDP's all-reduce, then each owner broadcasts its
   updated parameters: 2(N-1)/N G + (N-1)/N P) and FSDP (all-gather parameters in forward and
   in backward + reduce-scatter gradients: (N-1)/N (2P + G)). Ring algorithms; bytes each
   device receives (and sends).
4. Compute-bound batch size for FSDP (X-way) combined with tensor parallelism (Y-way), forward
   pass only, following the TPU Scaling Book (Austin et al. 2025, part 5, "FSDP + TP"):
   each layer is an MLP with weights W_in (D, F) and W_out (F, D); B tokens in the global batch,
   N = X * Y chips, C FLOP/s per chip, W one-way ICI bandwidth per link direction set, M_X and
   M_Y the number of mesh axes each parallelism spans (so its collectives get M * W).
       T_math = 2 * 2 * B * D * F / (N * C)          (two matmuls, 2 FLOPs per MAC)
       T_fsdp = 2 * 2 * D * F / (Y * W * M_X)       (all-gather both bf16 weight shards over X)
       T_tp   = 2 * 2 * B * D / (X * W * M_Y)       (all-gather + reduce-scatter bf16 activations
                                                     over Y)
   Compute-bound when T_math >= T_fsdp + T_tp. Dividing by 4D and multiplying by X * Y:
       B * F / C >= X * F / (W * M_X) + B * Y / (W * M_Y)
       B >= (X * F * C / M_X) / (F * W - Y * C / M_Y)      (never, if F * W <= Y * C / M_Y)
   The Scaling Book's per-chip batch is B / N; tokens per FSDP (data) shard are B / X.
   Handout (c): TPU v5p, W = 2 * 9e10, C = 4.6e14, M_X = 2, M_Y = 1, X = 16, Y = 4.

Activations saved for backward (elements, times the activation dtype's bytes):
- XXL ("ffn-only" models, handout simplification: each block is two linears, no activation
  function, no attention/embeddings/head): each linear saves its input, so per block
  B * T * (D + F).
- lm_core TransformerLM (a documented estimate of what autograd keeps; perf_tools.zero
  measures the real thing): per block B * T * (10 D + 4 F): the two RMSNorm inputs 2 D, the
  q/k/v projection's input D and output 3 D (v is a view that keeps all of it alive), rotated
  q and k 2 D, the attention output D (the output projection reads it through a view), the
  SwiGLU input D, the w1|w3 output 2 F, silu's output F and the gated product F. Fused
  attention backends add the log-sum-exp (B, H, T) in fp32. `naive` attention keeps instead
  contiguous copies of q, k^T, v and of its output (4 D in place of the 6 D above) and the
  softmax probabilities B * H * T^2: per block B * T * (8 D + 4 F) + B * H * T^2. After the
  blocks: B * T * (2 D + V) (final-norm input, head input, logits). Per-row statistics
  (RMSNorm's rstd) are ignored. Where RMSNorm is not one fused kernel (torch's CPU path)
  each norm also keeps x * rstd: + D per norm (`composite_norm`). Against autograd's saved
  tensors on CPU (tiny and small presets) this is within 3%.

Units: bytes; tables show decimal GB (1e9 bytes), as the handout's "80GB" / "95GB" devices.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from perf_tools import _cli, report

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp64": 8}


@dataclass(frozen=True)
class ModelDims:
    """What the accounting needs of a model. `ffn_only`: blocks of two linears, nothing else."""

    name: str
    d_model: int
    d_ff: int
    num_layers: int
    vocab_size: int = 0
    num_heads: int = 1
    ffn_only: bool = False


# The handout's XXL: d_model 16384, d_ff 53248, 126 blocks of two linears (FFN-only).
XXL = ModelDims("xxl", d_model=16384, d_ff=53248, num_layers=126, ffn_only=True)


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor; optimizer state per parameter (AdamW: 2)."""

    master: int = 4
    grad: int = 4
    optim_state: int = 4
    optim_values: int = 2  # AdamW keeps exp_avg and exp_avg_sq
    activation: int = 2
    comm: int = 2


def preset(name: str) -> ModelDims:
    """'xxl' or an lm_core preset name ('tiny', 'small', ..., 'xl', '2.7B')."""
    if name.lower() == "xxl":
        return XXL
    from lm_core import MODEL_SIZES

    if name not in MODEL_SIZES:
        raise ValueError(f"size: expected xxl or one of {', '.join(MODEL_SIZES)}, got {name!r}")
    c = MODEL_SIZES[name]
    return ModelDims(name, c.d_model, c.d_ff, c.num_layers, c.vocab_size, c.num_heads)


def param_count(m: ModelDims) -> int:
    """Parameters. FFN-only: L * 2 * D * F. lm_core: embeddings and head 2 V D, per block
    q/k/v/o 4 D^2 + SwiGLU 3 D F + two RMSNorm weights 2 D, final RMSNorm D."""
    if m.ffn_only:
        return m.num_layers * 2 * m.d_model * m.d_ff
    d, f = m.d_model, m.d_ff
    return 2 * m.vocab_size * d + m.num_layers * (4 * d * d + 3 * d * f + 2 * d) + d


def activation_elements(
    m: ModelDims, tokens: int, seq: int, attention: str = "sdpa", composite_norm: bool = False
) -> int:
    """Elements saved for backward for `tokens` = batch * seq tokens (see module docstring).

    The naive-attention term (B * H * T^2) needs the sequence length `seq`. `composite_norm`:
    RMSNorm runs as separate ops (torch's CPU path), which also keep x * rstd (+D per norm).
    """
    d, f = m.d_model, m.d_ff
    if m.ffn_only:
        return m.num_layers * tokens * (d + f)
    extra = d if composite_norm else 0
    batch = tokens // seq
    if attention == "naive":
        per_block = tokens * (8 * d + 4 * f + 2 * extra) + batch * m.num_heads * seq * seq
    else:
        per_block = tokens * (10 * d + 4 * f + 2 * extra)
    return m.num_layers * per_block + tokens * (2 * d + extra + m.vocab_size)


def lse_bytes(m: ModelDims, tokens: int, attention: str) -> int:
    """fp32 log-sum-exp (B, H, T) that fused attention backends keep, per model."""
    if m.ffn_only or attention == "naive":
        return 0
    return m.num_layers * tokens * m.num_heads * 4


@dataclass(frozen=True)
class Memory:
    """Bytes of each component on one device without sharding."""

    params: int
    master: int
    grads: int
    optim_state: int
    activations: int

    @property
    def model_states(self) -> int:
        return self.master + self.grads + self.optim_state

    @property
    def total(self) -> int:
        return self.model_states + self.activations


def memory(m: ModelDims, dt: Dtypes, batch: int, seq: int, attention: str = "sdpa") -> Memory:
    """Single-device memory of `m` training on `batch` sequences of `seq` tokens."""
    n = param_count(m)
    tokens = batch * seq
    act = activation_elements(m, tokens, seq, attention) * dt.activation
    act += lse_bytes(m, tokens, attention)
    return Memory(
        params=n,
        master=n * dt.master,
        grads=n * dt.grad,
        optim_state=n * dt.optim_state * dt.optim_values,
        activations=act,
    )


def fsdp_bytes(mem: Memory, n: int, sharded_activation_fraction: float = 0.5) -> float:
    """Per-device bytes with model states and a fraction of the activations sharded N ways."""
    if n < 1:
        raise ValueError(f"n: expected >= 1 devices, got {n}")
    sharded = mem.model_states + sharded_activation_fraction * mem.activations
    return sharded / n + (1 - sharded_activation_fraction) * mem.activations


def min_devices(
    mem: Memory, device_bytes: float, sharded_activation_fraction: float = 0.5
) -> int | None:
    """Smallest N with fsdp_bytes(mem, N) <= device_bytes; None if the unsharded part alone
    (the other activations) does not fit."""
    fixed = (1 - sharded_activation_fraction) * mem.activations
    if fixed >= device_bytes:
        return None
    sharded = mem.model_states + sharded_activation_fraction * mem.activations
    n = max(1, math.ceil(sharded / (device_bytes - fixed)))
    while fsdp_bytes(mem, n, sharded_activation_fraction) > device_bytes:  # float rounding
        n += 1
    return n


def comm_per_step(params: int, n: int, grad_bytes: int, param_bytes: int) -> dict[str, float]:
    """Bytes each device receives per step under N-way data parallelism (ring collectives).

    ddp: all-reduce grads; zero1: reduce-scatter grads + all-gather params; zero_shard:
    all-reduce grads + owner broadcasts of params; fsdp: all-gather params twice (forward,
    backward) + reduce-scatter grads.
    """
    g, p = params * grad_bytes, params * param_bytes
    frac = (n - 1) / n
    return {
        "ddp_GB": 2 * frac * g,
        "zero1_GB": frac * (g + p),
        "zero_shard_GB": 2 * frac * g + frac * p,
        "fsdp_GB": frac * (2 * p + g),
    }


@dataclass(frozen=True)
class Mesh:
    """Chips and links for the FSDP x TP analysis (defaults: handout (c), TPU v5p)."""

    flops: float = 4.6e14  # C, FLOP/s per chip
    bandwidth: float = 2 * 9e10  # W_ici, bytes/s
    m_x: int = 2
    m_y: int = 1
    x: int = 16  # FSDP ways
    y: int = 4  # TP ways


def compute_bound_batch(d_ff: int, mesh: Mesh) -> dict[str, float]:
    """Smallest global batch B (tokens) with T_math >= T_fsdp + T_tp (module docstring)."""
    c, w = mesh.flops, mesh.bandwidth
    denom = d_ff * w - mesh.y * c / mesh.m_y
    n = mesh.x * mesh.y
    if denom <= 0:
        inf = math.inf
        return {"global_tokens": inf, "tokens_per_chip": inf, "tokens_per_fsdp_shard": inf}
    b = (mesh.x * d_ff * c / mesh.m_x) / denom
    return {"global_tokens": b, "tokens_per_chip": b / n, "tokens_per_fsdp_shard": b / mesh.x}


# ------------------------------------------------------------------ CLI
def _dtype(text: str) -> int:
    try:
        return DTYPE_BYTES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(DTYPE_BYTES)}; got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.accounting",
        description="Memory and communication accounting of a model under FSDP / ZeRO "
        "(handout 2.4 communication_accounting and section 3).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python -m perf_tools.accounting                       # XXL, the handout's answers\n"
        "  python -m perf_tools.accounting --size xl --batch 2 --seq 512 --devices 2\n"
        "  python -m perf_tools.accounting --d-model 8192 --d-ff 28672 --num-layers 80 "
        "--ffn-only\n\n"
        "communication schemes (bytes each device receives per step, ring collectives):\n"
        "  ddp         all-reduce grads                        2 (N-1)/N G\n"
        "  zero1       reduce-scatter grads + all-gather params  (N-1)/N (G + P)\n"
        "  zero_shard  all-reduce grads + owner broadcasts      2 (N-1)/N G + (N-1)/N P\n"
        "  fsdp        2 all-gathers of params + reduce-scatter  (N-1)/N (2 P + G)\n",
    )
    m = p.add_argument_group("model")
    m.add_argument("--size", default="xxl", help="xxl (default) or an lm_core preset name")
    m.add_argument("--d-model", type=_cli.positive_int, help="custom: residual width")
    m.add_argument("--d-ff", type=_cli.positive_int, help="custom: feed-forward width")
    m.add_argument("--num-layers", type=_cli.positive_int, help="custom: number of blocks")
    m.add_argument("--vocab-size", type=_cli.positive_int, default=10_000, help="custom")
    m.add_argument("--num-heads", type=_cli.positive_int, default=1, help="custom")
    m.add_argument("--ffn-only", action="store_true", help="custom: blocks of two linears only")
    m.add_argument(
        "--attention",
        type=_cli.choice(["sdpa", "naive"]),
        default="sdpa",
        help="lm_core models: fused attention (keeps log-sum-exp) or naive (keeps T^2 probs)",
    )
    w = p.add_argument_group("workload and dtypes")
    w.add_argument("--batch", type=_cli.positive_int, default=1, help="sequences per device")
    w.add_argument("--seq", type=_cli.positive_int, default=1, help="tokens per sequence")
    for name, default, what in (
        ("master", "fp32", "master weights"),
        ("grad", "fp32", "accumulated gradients"),
        ("optim-state", "fp32", "optimizer state"),
        ("activation", "bf16", "activations saved for backward"),
        ("comm", "bf16", "gradient / parameter communication"),
    ):
        w.add_argument(f"--{name}-dtype", type=_dtype, default=_dtype(default), help=what)
    w.add_argument(
        "--optim-values",
        type=_cli.nonneg_int,
        default=2,
        help="optimizer-state values per parameter (AdamW: 2, SGD momentum: 1)",
    )
    d = p.add_argument_group("devices")
    d.add_argument(
        "--device-memory-gb",
        type=_cli.positive_float,
        nargs="+",
        default=[80.0, 95.0],
        help="device memories for the fit questions (H100 80, TPU v5p 95)",
    )
    d.add_argument(
        "--devices",
        type=_cli.positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="N values for the FSDP and communication tables",
    )
    d.add_argument(
        "--sharded-activations",
        type=float,
        default=0.5,
        help="fraction of the activations sharded under FSDP (handout (b): 0.5)",
    )
    mesh = p.add_argument_group("FSDP x TP mesh (handout (c) defaults: TPU v5p)")
    mesh.add_argument("--chip-flops", type=_cli.positive_float, default=Mesh.flops, help="C")
    mesh.add_argument(
        "--ici-bandwidth", type=_cli.positive_float, default=Mesh.bandwidth, help="W_ici, B/s"
    )
    mesh.add_argument("--mx", type=_cli.positive_int, default=Mesh.m_x, help="M_X")
    mesh.add_argument("--my", type=_cli.positive_int, default=Mesh.m_y, help="M_Y")
    mesh.add_argument("--fsdp", type=_cli.positive_int, default=Mesh.x, help="X (FSDP ways)")
    mesh.add_argument("--tp", type=_cli.positive_int, default=Mesh.y, help="Y (TP ways)")
    _cli.add_output_args(p, plot=False)
    return p


@dataclass(frozen=True)
class AccountingConfig:
    """What one accounting report computes (the CLI's flags, typed). The model: custom dims
    when all of d_model, d_ff and num_layers are given, else the preset `size`."""

    size: str = "xxl"
    d_model: int | None = None
    d_ff: int | None = None
    num_layers: int | None = None
    vocab_size: int = 10_000  # custom models only (FFN-only ones have none)
    num_heads: int = 1
    ffn_only: bool = False
    attention: str = "sdpa"
    batch: int = 1  # sequences per device
    seq: int = 1
    dtypes: Dtypes = Dtypes()
    # lists are accepted for these two, held as tuples
    device_memory_gb: tuple[float, ...] = (80.0, 95.0)
    devices: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    sharded_activations: float = 0.5
    mesh: Mesh = Mesh()

    def __post_init__(self) -> None:
        if self.attention not in ("sdpa", "naive"):
            raise ValueError(f"attention: expected sdpa or naive, got {self.attention!r}")
        for name in ("batch", "seq", "num_heads", "d_model", "d_ff", "num_layers"):
            if getattr(self, name) is not None:
                _cli.config_int(name, getattr(self, name), 1)
        _cli.config_int("vocab_size", self.vocab_size, 0)
        # lists are accepted and held as tuples, so the frozen config hashes
        devices = _cli.config_tuple("devices", self.devices)
        object.__setattr__(
            self, "devices", tuple(_cli.config_int("devices", n, 1) for n in devices)
        )
        sizes = _cli.config_tuple("device_memory_gb", self.device_memory_gb)
        sizes = tuple(_cli.config_number("device_memory_gb", gb, 0) for gb in sizes)
        object.__setattr__(self, "device_memory_gb", sizes)
        # These messages are the CLI's (accounting.main prints them), so they name the
        # flags the user typed; the checks above are argparse's there.
        _cli.config_number(
            "--sharded-activations", self.sharded_activations, 0, closed=True, high=1,
            expected="a fraction in [0, 1]",
        )  # fmt: skip
        custom = (self.d_model, self.d_ff, self.num_layers)
        if any(v is not None for v in custom) and any(v is None for v in custom):
            raise ValueError("custom model: give all of --d-model, --d-ff and --num-layers")
        if all(v is None for v in custom):
            preset(self.size)  # an unknown name fails here: "size: expected ..."


def model_from_config(cfg: AccountingConfig) -> ModelDims:
    """The custom dims of `cfg`, or its preset."""
    if cfg.d_model is not None and cfg.d_ff is not None and cfg.num_layers is not None:
        return ModelDims(
            "custom",
            cfg.d_model,
            cfg.d_ff,
            cfg.num_layers,
            0 if cfg.ffn_only else cfg.vocab_size,
            cfg.num_heads,
            ffn_only=cfg.ffn_only,
        )
    return preset(cfg.size)


def tables(cfg: AccountingConfig) -> dict[str, list[dict[str, Any]]]:
    """Every table of the report, as rows."""
    m = model_from_config(cfg)
    dt = cfg.dtypes
    mem = memory(m, dt, cfg.batch, cfg.seq, cfg.attention)
    tokens = cfg.batch * cfg.seq
    frac = cfg.sharded_activations
    single = []
    for what, nbytes in (
        ("master weights", mem.master),
        ("accumulated gradients", mem.grads),
        ("optimizer state", mem.optim_state),
        ("weights + grads + optimizer", mem.model_states),
        (f"activations ({tokens} tokens)", mem.activations),
        ("total", mem.total),
    ):
        row: dict[str, Any] = {"component": what, "bytes": nbytes, "GB": nbytes / GB}
        for cap in cfg.device_memory_gb:
            row[f"x {cap:g}GB devices"] = nbytes / (cap * GB)
        single.append(row)
    single.append(
        {
            "component": "activations per token",
            "bytes": mem.activations / tokens,
            "GB": mem.activations / tokens / GB,
        }
    )
    fsdp = []
    ns = sorted(
        set(cfg.devices)
        | {n for c in cfg.device_memory_gb if (n := min_devices(mem, c * GB, frac))}
    )
    for n in ns:
        per = fsdp_bytes(mem, n, frac)
        row = {
            "N": n,
            "model_states_GB": mem.model_states / n / GB,
            "sharded_act_GB": frac * mem.activations / n / GB,
            "replicated_act_GB": (1 - frac) * mem.activations / GB,
            "per_device_GB": per / GB,
        }
        for cap in cfg.device_memory_gb:
            row[f"fits {cap:g}GB"] = per <= cap * GB
        fsdp.append(row)
    fits = [
        {"device_GB": cap, "min_fsdp_devices": min_devices(mem, cap * GB, frac)}
        for cap in cfg.device_memory_gb
    ]
    comm = []
    for n in cfg.devices:
        if n >= 2:
            volumes = comm_per_step(mem.params, n, dt.comm, dt.comm)
            comm.append({"N": n, **{k: v / GB for k, v in volumes.items()}})
    mesh = cfg.mesh
    cb = compute_bound_batch(m.d_ff, mesh)
    bound = [
        {
            "C_TFLOPs": mesh.flops / 1e12,
            "W_ici_GBps": mesh.bandwidth / GB,
            "M_X": mesh.m_x,
            "M_Y": mesh.m_y,
            "X_fsdp": mesh.x,
            "Y_tp": mesh.y,
            "d_ff": m.d_ff,
            "compute_bound_possible": math.isfinite(cb["global_tokens"]),
            **{k: (v if math.isfinite(v) else None) for k, v in cb.items()},
        }
    ]
    summary = [{**asdict(m), "params": mem.params, "batch": cfg.batch, "seq": cfg.seq}]
    return {
        "model": summary,
        "memory": single,
        "fsdp": fsdp,
        "fits": fits,
        "communication": comm,
        "compute_bound": bound,
    }


def config_from_args(a: argparse.Namespace) -> AccountingConfig:
    """The parsed flags as a config (ValueError: a bad combination, named)."""
    return AccountingConfig(
        **_cli.model_dim_fields(a),
        attention=a.attention,
        batch=a.batch,
        seq=a.seq,
        dtypes=Dtypes(
            master=a.master_dtype,
            grad=a.grad_dtype,
            optim_state=a.optim_state_dtype,
            optim_values=a.optim_values,
            activation=a.activation_dtype,
            comm=a.comm_dtype,
        ),
        device_memory_gb=tuple(a.device_memory_gb),
        devices=tuple(a.devices),
        sharded_activations=a.sharded_activations,
        mesh=Mesh(a.chip_flops, a.ici_bandwidth, a.mx, a.my, a.fsdp, a.tp),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        out = tables(cfg)
    except ValueError as exc:
        parser.error(str(exc))
    titles = {
        "model": "Model",
        "memory": "Memory on one device (no sharding)",
        "fsdp": f"Per-device memory under N-way FSDP ({cfg.sharded_activations:g} of the "
        "activations sharded)",
        "fits": "Smallest FSDP degree that fits",
        "communication": "GB received per step and device, N-way data parallelism "
        "(schemes: see --help)",
        "compute_bound": "Compute-bound batch, FSDP x TP, forward pass (Scaling Book part 5)",
    }
    for key, rows in out.items():
        report.print_table(rows, title=titles[key])
    rows = [{"table": k, **r} for k, rs in out.items() for r in rs]
    report.save_rows(rows, csv_path=args.csv, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
