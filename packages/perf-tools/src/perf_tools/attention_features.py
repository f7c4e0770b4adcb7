"""Speed of flashattn-triton's attention features against PyTorch SDPA:
`python -m perf_tools.attention_features [gqa] [varlen] [window] [decode] [kvcache]`.

  gqa     32 query heads, 8 k/v heads, d 128, causal, N 4096 (batch 4) and 16384 (batch 1):
          ours (k/v read per group, no expanded copy) vs SDPA with enable_gqa.
  varlen  8 documents of random lengths summing to 16384 tokens, 16 heads, d 128, causal:
          ours (flash_attention_varlen, one launch) vs SDPA on the documents padded to the
          longest one (batch 8, causal: padding keys come after every real query, so no mask
          is needed; the padding copies are not timed) vs ours one document at a time.
  window  a 4096-token sliding window at N 32768, batch 1, 16 heads, d 128: ours windowed vs
          ours and SDPA full causal (what runs without window support) and SDPA given the
          window as a boolean mask.
  decode  1 query against a cache, d 128, forward only: batch 8 x 32 heads with 8K and 64K
          keys, and batch 1 x 32 q / 8 k/v heads with 64K keys (few programs: split-KV's
          case); ours (split-KV) vs ours with the split path off vs SDPA.
  kvcache 1 query per sequence against a preallocated cache of 16384 rows filled to a random
          length per sequence, batch 8, 32 q / 8 k/v heads, d 128, forward only: ours
          (flash_attention_kvcache, the lengths on the GPU) vs SDPA over the whole cache with
          the unfilled rows masked (a static-shape decode step) vs SDPA on each sequence's
          filled rows, one call per sequence; and the whole step of a decode loop, the new
          token's key and value stored at each sequence's length then attended: ours in one
          call (k=, v=) vs an index_put into the cache and the masked SDPA.

Every cell is a do_bench median (warm-up apart) of the eager call; forward+backward cells
take the gradients of q, k, v for a fixed dO. TFLOP/s counts the useful work only: 4 d
FLOPs per visible (query, key) pair forward, 3.5x that forward+backward (FlashAttention's
convention), so padded or masked-out work earns nothing. `speedup` is SDPA's time over this
provider's in the same case (the padded / full-causal SDPA row for varlen and window).
Without a GPU every case runs at tiny sizes on the PyTorch backend (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from perf_tools import _cli, report, timing

CASES = ("gqa", "varlen", "window", "decode", "kvcache")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (GPU sizes, CPU smoke sizes) per case.
SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "gqa": (
        {"shapes": [(4, 4096), (1, 16384)], "heads": 32, "kv_heads": 8, "d": 128},
        {"shapes": [(1, 64)], "heads": 4, "kv_heads": 2, "d": 16},
    ),
    "varlen": (
        {"total": 16384, "docs": 8, "heads": 16, "d": 128},
        {"total": 128, "docs": 4, "heads": 2, "d": 16},
    ),
    "window": (
        {"batch": 1, "n": 32768, "window": 4096, "heads": 16, "d": 128},
        {"batch": 1, "n": 128, "window": 16, "heads": 2, "d": 16},
    ),
    "decode": (  # shapes: (batch, q heads, k/v heads, keys)
        {"shapes": [(8, 32, 32, 8192), (8, 32, 32, 65536), (1, 32, 8, 65536)], "d": 128},
        {"shapes": [(2, 4, 4, 64), (2, 4, 4, 128), (1, 4, 2, 128)], "d": 16},
    ),
    "kvcache": (
        {"batch": 8, "heads": 32, "kv_heads": 8, "rows": 16384, "d": 128},
        {"batch": 2, "heads": 4, "kv_heads": 2, "rows": 64, "d": 16},
    ),
}


@dataclass(frozen=True)
class FeaturesConfig:
    """What one run measures (the CLI's flags, typed)."""

    device: torch.device  # a name ('cpu', 'cuda:0') is accepted, held as a torch.device
    cases: tuple[str, ...] = CASES  # run in this order (a list is accepted, held as a tuple)
    dtype: str = "bf16"  # on CUDA; the CPU smoke run is float32 whatever this says
    rep_ms: float = 200.0  # do_bench rep
    warmup_ms: float = 50.0  # do_bench warm-up
    window_mask: bool = True  # the window case also times SDPA given the window as a mask
    seed: int = 0

    def __post_init__(self) -> None:
        # a device name or a list of cases is accepted; stored as a torch.device and a tuple
        object.__setattr__(self, "device", _cli.config_device(self.device))
        object.__setattr__(self, "cases", _cli.config_tuple("cases", self.cases, CASES))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("rep_ms", "warmup_ms"):
            _cli.config_number(name, getattr(self, name), 0)
        _cli.config_int("seed", self.seed)


@dataclass
class Cell:
    """One provider in one case: what to time and the useful forward FLOPs."""

    provider: str
    fwd: Callable[[], Any]
    fwd_bwd: Callable[[], Any] | None  # None: forward only (decode)
    fwd_flops: float
    baseline: bool = False  # the SDPA row the speedups of this case divide
    # entered around the cell's whole measurement (warm-up included), e.g. a package setting
    setting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def causal_pairs(n: int, window: int | None = None) -> int:
    """(query, key) pairs of a causal N x N mask, within ``window`` keys back if given."""
    if window is None or window >= n - 1:
        return n * (n + 1) // 2
    w = window
    return (w + 1) * (w + 2) // 2 + (n - w - 1) * (w + 1)


def _randn(shape, dtype, device, gen, grad=True) -> torch.Tensor:
    t = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


def _grad_fn(run: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], do) -> Callable:
    def fwd_bwd() -> Any:
        return torch.autograd.grad(run(), inputs, do)

    return fwd_bwd


@contextlib.contextmanager
def _split_kv(on: bool) -> Iterator[None]:
    """The decode path of flashattn-triton on (default) or off. Launch plans and remembered
    calls are cleared on the way in and out: a remembered call would replay the path its
    first call took, whatever the threshold says now."""
    from flashattn_triton import configs
    from flashattn_triton.launch import clear_plans

    saved = configs.DECODE_MIN_KEYS
    if not on:
        configs.DECODE_MIN_KEYS = 1 << 62
    clear_plans()
    try:
        yield
    finally:
        configs.DECODE_MIN_KEYS = saved
        clear_plans()


def gqa_cells(size: dict, batch: int, n: int, dtype, device, gen) -> list[Cell]:
    from flashattn_triton import flash_attention

    h, h_kv, d = size["heads"], size["kv_heads"], size["d"]
    q = _randn((batch, h, n, d), dtype, device, gen)
    k, v = (_randn((batch, h_kv, n, d), dtype, device, gen) for _ in range(2))
    do = torch.randn_like(q)
    flops = 4.0 * d * batch * h * causal_pairs(n)

    def ours() -> torch.Tensor:
        return flash_attention(q, k, v, causal=True)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return [
        Cell("ours", ours, _grad_fn(ours, (q, k, v), do), flops),
        Cell("sdpa-enable_gqa", sdpa, _grad_fn(sdpa, (q, k, v), do), flops, baseline=True),
    ]


def document_lengths(total: int, docs: int, gen: torch.Generator) -> list[int]:
    """``docs`` random positive lengths summing to ``total`` (uniform cut points)."""
    cuts = torch.randperm(total - 1, generator=gen)[: docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def varlen_cells(size: dict, dtype, device, gen) -> tuple[list[Cell], list[int]]:
    from flashattn_triton import flash_attention, flash_attention_varlen

    h, d = size["heads"], size["d"]
    lens = document_lengths(size["total"], size["docs"], gen)
    total, longest = sum(lens), max(lens)
    q, k, v = (_randn((total, h, d), dtype, device, gen) for _ in range(3))
    do = torch.randn_like(q)
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    flops = 4.0 * d * h * sum(causal_pairs(n) for n in lens)

    def ours() -> torch.Tensor:
        return flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    def per_document() -> list[torch.Tensor]:
        return [
            flash_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), causal=True)
            for a, b in itertools.pairwise(cu_list)
        ]  # (H, n, d) each

    do_docs = [do[a:b].transpose(0, 1) for a, b in itertools.pairwise(cu_list)]

    def per_document_fwd_bwd() -> Any:
        return torch.autograd.grad(per_document(), (q, k, v), do_docs)

    padded = []
    for t in (q, k, v):  # (docs, H, longest, d), zero padding after each document
        p = t.new_zeros((len(lens), h, longest, d))
        for i, (a, b) in enumerate(itertools.pairwise(cu_list)):
            p[i, :, : b - a] = t[a:b].transpose(0, 1).detach()
        padded.append(p.requires_grad_())
    do_pad = torch.randn_like(padded[0])

    def sdpa_padded() -> torch.Tensor:
        return F.scaled_dot_product_attention(*padded, is_causal=True)

    cells = [
        Cell("ours-varlen", ours, _grad_fn(ours, (q, k, v), do), flops),
        Cell("ours-per-document", per_document, per_document_fwd_bwd, flops),
        Cell("sdpa-padded", sdpa_padded, _grad_fn(sdpa_padded, padded, do_pad), flops, True),
    ]
    return cells, lens


def window_cells(size: dict, dtype, device, gen, with_mask: bool) -> list[Cell]:
    from flashattn_triton import flash_attention

    b, n, w, h, d = size["batch"], size["n"], size["window"], size["heads"], size["d"]
    q, k, v = (_randn((b, h, n, d), dtype, device, gen) for _ in range(3))
    do = torch.randn_like(q)
    windowed = 4.0 * d * b * h * causal_pairs(n, w)

    def ours() -> torch.Tensor:
        return flash_attention(q, k, v, causal=True, window_size=(w, 0))

    def ours_full() -> torch.Tensor:
        return flash_attention(q, k, v, causal=True)

    def sdpa_full() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cells = [
        Cell("ours-window", ours, _grad_fn(ours, (q, k, v), do), windowed),
        Cell("ours-full-causal", ours_full, _grad_fn(ours_full, (q, k, v), do), windowed),
        Cell("sdpa-full-causal", sdpa_full, _grad_fn(sdpa_full, (q, k, v), do), windowed, True),
    ]
    if with_mask:
        i = torch.arange(n, device=device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= w)  # (N, N)

        def sdpa_mask() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        cells.append(
            Cell("sdpa-window-mask", sdpa_mask, _grad_fn(sdpa_mask, (q, k, v), do), windowed)
        )
    return cells


def decode_cells(shape: tuple[int, int, int, int], d: int, dtype, device, gen) -> list[Cell]:
    from flashattn_triton import flash_attention

    b, h, h_kv, keys = shape
    q = _randn((b, h, 1, d), dtype, device, gen, grad=False)
    k, v = (_randn((b, h_kv, keys, d), dtype, device, gen, grad=False) for _ in range(2))
    flops = 4.0 * d * b * h * keys

    def ours() -> torch.Tensor:
        return flash_attention(q, k, v, causal=True)

    def sdpa() -> torch.Tensor:  # one query sees every key: no mask (SDPA aligns top-left)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=h_kv != h)

    return [
        Cell("ours-split-kv", ours, None, flops),
        Cell("ours-no-split", ours, None, flops, setting=lambda: _split_kv(False)),
        Cell("sdpa", sdpa, None, flops, baseline=True),
    ]


def kvcache_cells(size: dict, dtype, device, gen) -> tuple[list[Cell], list[int]]:
    from flashattn_triton import flash_attention_kvcache

    b, h, h_kv, rows, d = (size[n] for n in ("batch", "heads", "kv_heads", "rows", "d"))
    lens = torch.randint(1, rows + 1, (b,), generator=gen).tolist()
    q = _randn((b, h, 1, d), dtype, device, gen, grad=False)
    k, v = (_randn((b, h_kv, rows, d), dtype, device, gen, grad=False) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    filled = torch.arange(rows, device=device)[None, :] < seqlens[:, None]  # (B, S)
    mask = filled[:, None, None, :]  # (B, 1, 1, S): the new query sees the filled rows
    flops = 4.0 * d * h * sum(lens)

    def ours() -> torch.Tensor:
        return flash_attention_kvcache(q, k, v, seqlens, causal=True)

    def sdpa_masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h_kv != h)

    def sdpa_per_sequence() -> list[torch.Tensor]:
        return [
            F.scaled_dot_product_attention(
                q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], enable_gqa=h_kv != h
            )
            for i, n in enumerate(lens)
        ]

    # A decode step that also stores its token's key and value (row lens[b] - 1, so that the
    # attended rows are the same as above); every call rewrites the same rows.
    k_new, v_new = (_randn((b, h_kv, 1, d), dtype, device, gen, grad=False) for _ in range(2))
    before = seqlens - 1
    batch_rows = torch.arange(b, device=device)[:, None]  # (B, 1)
    new_rows = before.long()[:, None]  # (B, 1)

    def ours_storing() -> torch.Tensor:
        return flash_attention_kvcache(q, k, v, before, causal=True, k=k_new, v=v_new)

    def sdpa_storing() -> torch.Tensor:
        k[batch_rows, :, new_rows] = k_new.transpose(1, 2)
        v[batch_rows, :, new_rows] = v_new.transpose(1, 2)
        return sdpa_masked()

    return [
        Cell("ours", ours, None, flops),
        Cell("sdpa-masked-cache", sdpa_masked, None, flops, baseline=True),
        Cell("sdpa-per-sequence", sdpa_per_sequence, None, flops),
        Cell("ours-storing-the-token", ours_storing, None, flops),
        Cell("sdpa-index_put-then-masked", sdpa_storing, None, flops),
    ], lens


def _measure(cell: Cell, device, warm: float, rep: float) -> dict[str, Any]:
    out: dict[str, Any] = {"provider": cell.provider, "status": "ok"}
    stage = "fwd"
    try:
        with cell.setting():
            grad = torch.no_grad() if cell.fwd_bwd is None else contextlib.nullcontext()
            with grad:
                out["fwd_ms"] = timing.bench_ms(cell.fwd, device=device, warmup_ms=warm, rep_ms=rep)
            out["fwd_tflops"] = cell.fwd_flops / (out["fwd_ms"] * 1e-3) / 1e12
            if cell.fwd_bwd is not None:
                stage = "fwd_bwd"
                ms = timing.bench_ms(cell.fwd_bwd, device=device, warmup_ms=warm, rep_ms=rep)
                out["fwd_bwd_ms"] = ms
                out["fwd_bwd_tflops"] = 3.5 * cell.fwd_flops / (ms * 1e-3) / 1e12
    except Exception as exc:  # a failed cell is a row, the sweep goes on
        if timing.is_oom(exc):
            out["status"] = "OOM" if stage == "fwd" else "OOM in fwd_bwd"
        else:
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            out["status"] = f"error: {type(exc).__name__}: {first}"
            traceback.print_exc()
    return out


def _speedups(rows: list[dict[str, Any]], baseline: str) -> None:
    base = next((r for r in rows if r["provider"] == baseline), None)
    for row in rows:
        for col in ("fwd_bwd_ms", "fwd_ms"):
            if base is not None and base.get(col) and row.get(col):
                row["speedup"] = base[col] / row[col]
                row["speedup_of"] = col.removesuffix("_ms")
                break


def _run_case(
    name: str, cells: list[Cell], shape: str, cfg: FeaturesConfig
) -> list[dict[str, Any]]:
    """One row per cell of a case, speedups against its baseline; the cells' tensors freed."""
    device = cfg.device
    rows = []
    for cell in cells:
        row = {"case": name, "shape": shape, **_measure(cell, device, cfg.warmup_ms, cfg.rep_ms)}
        rows.append(row)
    baseline = next((c.provider for c in cells if c.baseline), None)
    if baseline is not None:
        _speedups(rows, baseline)
    cells.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(
    cfg: FeaturesConfig, on_rows: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """Every requested case, one row per provider. ``on_rows(rows)`` runs after each shape
    with the rows so far (``main`` saves them, so a run stopped part-way keeps them)."""
    device = cfg.device
    dtype = DTYPES[cfg.dtype] if device.type == "cuda" else torch.float32
    gpu = device.type == "cuda"
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[dict[str, Any]] = []

    def add(shape_rows: list[dict[str, Any]]) -> None:
        rows.extend(shape_rows)
        if on_rows is not None:
            on_rows(rows)

    for case in cfg.cases:
        size = SIZES[case][0 if gpu else 1]
        if case == "gqa":
            for batch, n in size["shapes"]:
                shape = f"B{batch} Hq{size['heads']} Hkv{size['kv_heads']} N{n} d{size['d']}"
                cells = gqa_cells(size, batch, n, dtype, device, gen)
                add(_run_case(case, cells, shape, cfg))
        elif case == "varlen":
            cells, lens = varlen_cells(size, dtype, device, gen)
            shape = f"{len(lens)} docs {'+'.join(map(str, lens))} H{size['heads']} d{size['d']}"
            add(_run_case(case, cells, shape, cfg))
        elif case == "window":
            cells = window_cells(size, dtype, device, gen, with_mask=cfg.window_mask)
            shape = f"B{size['batch']} H{size['heads']} N{size['n']} W{size['window']} d{size['d']}"
            add(_run_case(case, cells, shape, cfg))
        elif case == "kvcache":
            cells, lens = kvcache_cells(size, dtype, device, gen)
            shape = (
                f"B{size['batch']} Hq{size['heads']} Hkv{size['kv_heads']} Nq1 "
                f"S{size['rows']} filled {'+'.join(map(str, lens))} d{size['d']}"
            )
            add(_run_case(case, cells, shape, cfg))
        else:
            for b, h, h_kv, keys in size["shapes"]:
                heads = f"H{h}" if h == h_kv else f"Hq{h} Hkv{h_kv}"
                shape = f"B{b} {heads} Nq1 Nk{keys} d{size['d']}"
                cells = decode_cells((b, h, h_kv, keys), size["d"], dtype, device, gen)
                add(_run_case(case, cells, shape, cfg))
    return rows


COLUMNS = [
    "case", "shape", "provider", "status", "fwd_ms", "fwd_bwd_ms", "fwd_tflops",
    "fwd_bwd_tflops", "speedup", "speedup_of",
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.attention_features",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    p.add_argument(
        "cases", nargs="*", type=_cli.choice(CASES), help=f"any of {', '.join(CASES)} (all)"
    )
    p.add_argument("--device", type=_cli.device_arg, help="cpu or cuda (default: cuda if any)")
    p.add_argument("--dtype", default="bf16", type=_cli.choice(list(DTYPES)), help="on CUDA")
    p.add_argument("--rep-ms", type=_cli.positive_float, default=200.0, help="do_bench rep")
    p.add_argument("--warmup-ms", type=_cli.positive_float, default=50.0, help="do_bench warm-up")
    p.add_argument(
        "--no-mask", action="store_true", help="leave out SDPA with the window as a mask"
    )
    p.add_argument("--seed", type=int, default=0)
    _cli.add_output_args(p, plot=False)
    return p


def config_from_args(a: argparse.Namespace) -> FeaturesConfig:
    """The parsed flags as a config: every case when none is named, each once."""
    device = a.device or torch.device(_cli.default_device())
    rep, warm = a.rep_ms, a.warmup_ms
    if device.type == "cpu":  # the smoke run: tiny sizes, short timings
        rep, warm = min(rep, 20.0), min(warm, 5.0)
    return FeaturesConfig(
        device=device,
        cases=tuple(dict.fromkeys(a.cases)) or CASES,
        dtype=a.dtype,
        rep_ms=rep,
        warmup_ms=warm,
        window_mask=not a.no_mask,
        seed=a.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: parse, run the cases, print and save the table; 1 if a cell erred."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    save = report.rows_saver(args.csv, args.json)
    rows = run(cfg, on_rows=save)
    dev = report.run_metadata()["device"]
    report.print_table(
        rows, COLUMNS, title=f"attention features on {dev}, {cfg.dtype}, do_bench median ms"
    )
    save(rows)
    return 1 if any(str(r["status"]).startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
