"""Decode throughput of lm_core's KV-cache generation: `python -m perf_tools.generate_bench`.

For every size x batch size x provider: a prompt of `--prompt-len` random tokens, then
`--new-tokens` greedy tokens. Prefill and decode are timed apart (the device synchronized
before each clock read), the median of `--repeats` runs; a first untimed run (compilation,
CUDA-graph capture, autotuning) is reported apart as `warmup_s`. Decode tokens/s =
batch x (new_tokens - 1) / decode time (the first new token comes from the prefill).

Providers:
  eager              lm_core.generation.Decoder, op by op
  compile            the decode step compiled by inductor (fullgraph, static cache shapes)
  cudagraph          the eager decode step captured once in a CUDA graph, replayed per token
  compile+cudagraph  the compiled step captured in a CUDA graph
  hf                 transformers LlamaForCausalLM.generate at the same dims (SDPA, its
                     default dynamic KV cache), greedy; skipped when transformers is missing
  hf-static          the same with cache_implementation="static" (transformers then compiles
                     the decode step itself on CUDA, mode="reduce-overhead")
`--attention sdpa flash-triton` times lm_core's providers with each attention backend (a row
each; with flash-triton the decode step reads only the cache's filled rows through
`flashattn_triton.flash_attention_kvcache`, with sdpa all of them under a mask); HF's rows
are its SDPA. Ours and HF's caches both hold prompt + new tokens positions; weights in
`--dtype` (bf16 on CUDA by default; lm_core keeps its RoPE tables in fp32). A cell that
cannot run here (no CUDA, no transformers) or runs out of memory is a row with a note, and so
is an HF cell whose decode time cannot be told apart from the noise (`not measured: ...`:
generating all the new tokens took no longer than generating one, as on a busy CPU with few
new tokens); any other failure is a row saying `error: ...` (traceback on stderr) and the
command exits 1 at the end.

Example (GPU):
  python -m perf_tools.generate_bench --sizes small xl --batch-sizes 1 16 --csv decode.csv
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from perf_tools import _cli, report
from perf_tools._compile import allow_recompiles
from perf_tools.models import build_model, resolve_config, size_names
from perf_tools.timing import is_oom, peak_memory_bytes, reset_peak_memory
from perf_tools.timing import synchronize as sync

PROVIDERS = ("eager", "compile", "cudagraph", "compile+cudagraph", "hf", "hf-static")
ATTENTIONS = ("sdpa", "flash-triton", "naive", "flash-torch")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = [
    "size",
    "batch",
    "provider",
    "attention",
    "dtype",
    "prompt",
    "new_tokens",
    "prefill_ms",
    "ms_per_step",
    "tokens_per_s",
    "warmup_s",
    "peak_mem_gib",
    "note",
]


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What one benchmark runs (the CLI's flags, typed): every size x batch size x provider,
    lm_core's providers once per attention backend."""

    # the sweep's axes: lists are accepted, held as tuples without repeats
    sizes: tuple[str, ...] = ("small", "xl")
    batch_sizes: tuple[int, ...] = (1, 16)
    providers: tuple[str, ...] = PROVIDERS
    attention: tuple[str, ...] = ("sdpa",)
    prompt_len: int = 128
    new_tokens: int = 256  # the first comes from the prefill: at least 2
    repeats: int = 3
    dtype: str | None = None  # a DTYPES key; None: bf16 on CUDA, else fp32
    # normalized to a torch.device (a name is accepted); None: cuda when visible, else cpu
    device: torch.device | str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        device = self.device if self.device is not None else _cli.default_device()
        object.__setattr__(self, "device", _cli.config_device(device))
        if self.dtype is None:
            object.__setattr__(self, "dtype", "bf16" if self.device.type == "cuda" else "fp32")
        # lists are accepted and held as tuples, each value once (as the CLI's)
        for name, allowed in (
            ("sizes", size_names()),
            ("batch_sizes", None),
            ("providers", PROVIDERS),
            ("attention", ATTENTIONS),
        ):
            values = _cli.config_tuple(name, getattr(self, name), allowed, unique=True)
            object.__setattr__(self, name, values)
        for b in self.batch_sizes:
            _cli.config_int("batch_sizes", b, 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("prompt_len", "repeats"):
            _cli.config_int(name, getattr(self, name), 1)
        _cli.config_int("new_tokens", self.new_tokens)
        if self.new_tokens < 2:  # the CLI's message: it names the flag
            raise ValueError(
                f"--new-tokens: expected at least 2 (one from the prefill), got {self.new_tokens}"
            )


class CellSkippedError(Exception):
    """This cell cannot run here; the message says why."""


class CellNotMeasuredError(Exception):
    """This cell ran but its time cannot be derived from what was measured; the message
    says why."""


def _median_runs(run: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float]:
    """Median prefill and decode seconds over `repeats` calls of `run`."""
    times = [run() for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def time_ours(model: Any, provider: str, prompt: torch.Tensor, new_tokens: int, repeats: int):
    """(warm-up s, prefill s, decode s) of lm_core's Decoder for `provider`."""
    from lm_core.generation import Decoder

    device = prompt.device
    graph = "cudagraph" in provider
    if graph and device.type != "cuda":
        raise CellSkippedError("CUDA graphs need a CUDA device")
    decoder = Decoder(
        model,
        max_len=prompt.shape[1] + new_tokens,
        compile=provider.startswith("compile"),
        cuda_graph=graph,
    )

    def run() -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        token = decoder.prefill(prompt).argmax(-1)  # (B,)
        sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = decoder.step(token).argmax(-1)  # stays on the device: no host sync
        sync(device)
        return t1 - t0, time.perf_counter() - t1

    t0 = time.perf_counter()
    run()
    warmup = time.perf_counter() - t0
    return (warmup, *_median_runs(run, repeats))


def time_hf(hf_model: Any, provider: str, prompt: torch.Tensor, new_tokens: int, repeats: int):
    """(warm-up s, prefill s, decode s) of LlamaForCausalLM.generate: prefill = the median
    time of 1 new token (the prefill and its first token), decode = the median time of
    `new_tokens` minus that. Raises CellNotMeasuredError where the difference is not
    positive (noise larger than the decode), rather than report a negative time."""
    device = prompt.device
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
    if provider == "hf-static":
        kwargs["cache_implementation"] = "static"

    def gen(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        out = hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        if out.shape[1] != prompt.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} tokens")
        return time.perf_counter() - t0

    def run() -> tuple[float, float]:
        return gen(1), gen(new_tokens)

    t0 = time.perf_counter()
    gen(new_tokens)
    warmup = time.perf_counter() - t0
    prefill, total = _median_runs(run, repeats)
    if total <= prefill:
        raise CellNotMeasuredError(
            f"generating {new_tokens} tokens took no longer than 1 ({total * 1e3:.3f} against "
            f"{prefill * 1e3:.3f} ms): the decode is within the noise; more --new-tokens"
        )
    return warmup, prefill, total - prefill


def _row(
    size: str, batch: int, provider: str, cfg: DecodeBenchConfig, attention: str = "sdpa"
) -> dict[str, Any]:
    """A row with every column, the measured ones empty."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(size=size, batch=batch, provider=provider, attention=attention, dtype=cfg.dtype)
    row.update(prompt=cfg.prompt_len, new_tokens=cfg.new_tokens)
    return row


def _measure(row: dict[str, Any], fn: Callable[[], tuple[float, float, float]], device) -> None:
    """Fill `row` from fn() -> (warm-up, prefill, decode) seconds; a skipped cell, an OOM or
    another failure becomes the row's note."""
    reset_peak_memory(device)
    try:
        try:
            warmup, prefill, decode = fn()
        finally:  # an OOM cell must not leave its cached blocks to the next one
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    except CellSkippedError as exc:
        row["note"] = f"skipped: {exc}"
        return
    except CellNotMeasuredError as exc:
        row["note"] = f"not measured: {exc}"
        return
    except Exception as exc:
        if is_oom(exc):
            row["note"] = "OOM"
        else:
            traceback.print_exc()
            first = (str(exc).splitlines() or [""])[0][:120]
            row["note"] = f"error: {type(exc).__name__}: {first}"
        return
    steps = row["new_tokens"] - 1
    peak = peak_memory_bytes(device)
    row.update(
        prefill_ms=prefill * 1e3,
        ms_per_step=decode / steps * 1e3,
        tokens_per_s=row["batch"] * steps / decode,
        warmup_s=warmup,
        peak_mem_gib=peak / 2**30 if peak is not None else None,
    )


def run_size(size: str, cfg: DecodeBenchConfig) -> list[dict[str, Any]]:
    """Every batch size x provider for one model size."""
    device, dtype = cfg.device, DTYPES[cfg.dtype]
    config = resolve_config(size, context_length=cfg.prompt_len + cfg.new_tokens)
    rows = []
    ours = [p for p in cfg.providers if not p.startswith("hf")]
    theirs = [p for p in cfg.providers if p.startswith("hf")]
    for attention in cfg.attention if ours else ():
        from lm_core.generation import cast_weights

        torch.manual_seed(0)
        ours_config = resolve_config(
            size, context_length=cfg.prompt_len + cfg.new_tokens, attention=attention
        )
        model = cast_weights(build_model(ours_config, device), dtype).eval()
        for batch in cfg.batch_sizes:
            prompt = torch.randint(0, config.vocab_size, (batch, cfg.prompt_len), device=device)
            for provider in ours:
                row = _row(size, batch, provider, cfg, attention)
                fn = partial(time_ours, model, provider, prompt, cfg.new_tokens, cfg.repeats)
                _measure(row, fn, device)
                rows.append(row)
                _progress(row, cfg)
        del model
    if theirs:
        from perf_tools.hf_baseline import MissingBaselineError, available, build_hf_llama_lm

        ok, note = available()
        hf_model = None
        if ok:
            torch.manual_seed(0)
            try:
                hf_model = build_hf_llama_lm(config, device, dtype)
            except MissingBaselineError as exc:
                ok, note = False, str(exc)
        for batch in cfg.batch_sizes:
            prompt = torch.randint(0, config.vocab_size, (batch, cfg.prompt_len), device=device)
            for provider in theirs:
                row = _row(size, batch, provider, cfg)
                if not ok:
                    row["note"] = f"skipped: {note}"
                else:
                    fn = partial(time_hf, hf_model, provider, prompt, cfg.new_tokens, cfg.repeats)
                    _measure(row, fn, device)
                rows.append(row)
                _progress(row, cfg)
        del hf_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _progress(row: dict[str, Any], cfg: DecodeBenchConfig) -> None:
    if cfg.quiet:
        return
    what = row.get("note") or f"{row['tokens_per_s']:,.0f} tokens/s"
    name = f"{row['provider']} {row['attention']}"
    print(f"  {row['size']} batch {row['batch']} {name}: {what}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf_tools.generate_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=_cli.listed(_cli.choice(size_names())),
        default=None,
        help="model presets (default: small xl)",
    )
    p.add_argument(
        "--batch-sizes",
        nargs="+",
        type=_cli.listed(_cli.positive_int),
        default=None,
        help="batch sizes (default: 1 16)",
    )
    p.add_argument(
        "--providers",
        nargs="+",
        type=_cli.listed(_cli.choice(PROVIDERS)),
        default=None,
        help=f"default: all ({', '.join(PROVIDERS)})",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        type=_cli.listed(_cli.choice(ATTENTIONS)),
        default=None,
        help=f"lm_core's attention backends for its rows (default: sdpa; {', '.join(ATTENTIONS)})",
    )
    p.add_argument("--prompt-len", type=_cli.positive_int, default=128, help="prompt tokens")
    p.add_argument(
        "--new-tokens",
        type=_cli.positive_int,
        default=256,
        help="generated tokens per run (at least 2)",
    )
    p.add_argument("--repeats", type=_cli.positive_int, default=3, help="timed runs per cell")
    p.add_argument(
        "--dtype", choices=list(DTYPES), help="weights (default: bf16 on CUDA, else fp32)"
    )
    p.add_argument("--device", type=_cli.device_arg, default=None, help="default: cuda if any")
    _cli.add_output_args(p, plot=False)
    p.set_defaults(csv=Path("generate_bench.csv"))
    return p


def config_from_args(a: argparse.Namespace) -> DecodeBenchConfig:
    """The parsed flags as a config; unset lists take their defaults."""
    return DecodeBenchConfig(
        sizes=tuple(_cli.flatten(a.sizes) or DecodeBenchConfig.sizes),
        batch_sizes=tuple(_cli.flatten(a.batch_sizes) or DecodeBenchConfig.batch_sizes),
        providers=tuple(_cli.flatten(a.providers) or PROVIDERS),
        attention=tuple(_cli.flatten(a.attention) or DecodeBenchConfig.attention),
        prompt_len=a.prompt_len,
        new_tokens=a.new_tokens,
        repeats=a.repeats,
        dtype=a.dtype,
        device=a.device,
        quiet=a.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    allow_recompiles()  # one compiled decode step per model and batch size
    rows = []
    for size in cfg.sizes:
        rows.extend(run_size(size, cfg))
    title = (
        f"greedy decode, prompt {cfg.prompt_len} + {cfg.new_tokens} new tokens, "
        f"{cfg.dtype}, {cfg.device.type}"
    )
    report.print_table(rows, COLUMNS, title=title)
    report.save_rows(rows, csv_path=args.csv, json_path=args.json)
    for what, path in (("csv", args.csv), ("json", args.json)):
        if path is not None:
            print(f"{what}: {path}")
    return 1 if any(str(r["note"]).startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
