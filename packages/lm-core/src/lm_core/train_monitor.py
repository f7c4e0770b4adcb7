"""What the trainer reports beside the loss: MFU, validation perplexity, TensorBoard events, text
samples, and what the token files' sidecars say about the model (vocabulary, end-of-text id).

`add_monitor_args(parser)` adds the flags; `check_monitor_args(parser, args)` validates them and
applies the `--data` sidecar (`lm_core.data.TokenFileMeta`): its vocabulary size replaces the
preset's (unless `--vocab-size` is given, which may not be smaller) and its end-of-text id is
kept as `args.eot_id` (recorded in checkpoints with the other flags, for `lm_core.generate`).
`Monitor` is built by the trainer on every rank and acts on rank 0 only.

MFU = tokens/s x FLOPs per token (`lm_core.flops.train_step_flops`: forward + backward, no
recomputation) / (peak FLOP/s x ranks). The peak is `--peak-tflops`, else the datasheet rate of
a known GPU for the run's precision (bf16 with `--bf16`, TF32 with `--tf32`, else fp32); on
other devices MFU is left out of the log.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lm_core.config import MODEL_SIZES
from lm_core.data import read_token_meta, token_meta_path
from lm_core.flops import train_step_flops

# Dense tensor-core / FMA peaks of the SXM parts, TFLOP/s (datasheets). `tf32` applies when
# TF32 matmuls are allowed; `fp32` is plain IEEE fp32 on the CUDA cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def add_monitor_args(parser: argparse.ArgumentParser) -> None:
    """The flag group of this module."""
    g = parser.add_argument_group("monitoring and samples")
    g.add_argument(
        "--log-dir",
        type=Path,
        help="TensorBoard events (if tensorboard is installed) and metrics.jsonl",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s per device for MFU [datasheet value of a known GPU]",
    )
    g.add_argument("--tokenizer", type=Path, help="tokenizer JSON, for --sample-every")
    g.add_argument(
        "--sample-every",
        type=int,
        default=0,
        help="steps between printed text samples (0: off; needs --tokenizer)",
    )
    g.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample")
    g.add_argument(
        "--sample-prompt", default="", help="prompt of the samples [empty: start a new document]"
    )
    g.add_argument("--sample-temperature", type=float, default=0.8, help="sampling temperature")


def check_monitor_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate this module's flags and apply the --data sidecar (call before the model
    config is built); problems exit through `parser.error` naming the flag."""
    if args.sample_every < 0:
        parser.error(f"--sample-every must be >= 0, got {args.sample_every}")
    if args.sample_tokens <= 0:
        parser.error(f"--sample-tokens must be positive, got {args.sample_tokens}")
    if args.sample_temperature < 0:
        parser.error(f"--sample-temperature must be >= 0, got {args.sample_temperature}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.sample_every and args.tokenizer is None:
        parser.error("--sample-every needs --tokenizer")
    if args.sample_every and args.fsdp != "none":
        parser.error(f"--sample-every is not supported with --fsdp {args.fsdp} (sharded weights)")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer: file not found: {args.tokenizer}")
    if args.metrics is None and args.log_dir is not None:
        args.metrics = args.log_dir / "metrics.jsonl"
    given_eot = getattr(args, "eot_id", None)  # --eot-id (with --pack-documents)
    args.eot_id = given_eot
    args.data_notes = []
    if args.data is None or args.data.suffix == ".npy":
        return
    try:
        meta = read_token_meta(args.data)
        val_meta = read_token_meta(args.val_data) if args.val_data is not None else None
    except ValueError as exc:
        parser.error(f"--data / --val-data: {exc}")
    if meta is None:
        return
    sidecar = token_meta_path(args.data)
    if args.data_dtype is not None and np.dtype(args.data_dtype) != np.dtype(meta.dtype):
        parser.error(f"--data-dtype {args.data_dtype}: {sidecar} says {meta.dtype}")
    if val_meta is not None:
        ours = (meta.dtype, meta.vocab_size, meta.eot_id)
        theirs = (val_meta.dtype, val_meta.vocab_size, val_meta.eot_id)
        if ours != theirs:
            parser.error(
                f"--val-data: (dtype, vocab_size, eot_id) = {theirs} in its sidecar, but "
                f"{ours} for --data: encoded with another tokenizer?"
            )
    preset = MODEL_SIZES[args.size].vocab_size
    if args.vocab_size is None:
        args.vocab_size = meta.vocab_size
        args.data_notes.append(
            f"vocab_size {meta.vocab_size} from {sidecar} (the {args.size} preset has {preset})"
        )
    elif args.vocab_size < meta.vocab_size:
        parser.error(
            f"--vocab-size {args.vocab_size} is smaller than the data's vocabulary "
            f"({meta.vocab_size}, from {sidecar})"
        )
    if given_eot is not None and given_eot != meta.eot_id:
        parser.error(f"--eot-id {given_eot}: {sidecar} says the end-of-text id is {meta.eot_id}")
    args.eot_id = meta.eot_id
    args.data_notes.append(f"end-of-text id {meta.eot_id} from {sidecar}")


def peak_tflops(args: argparse.Namespace, device: torch.device) -> float | None:
    """--peak-tflops, else the table's rate for this GPU and precision, else None."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    precision = "bf16" if args.bf16 else "tf32" if args.tf32 else "fp32"
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[precision]
    return None


def _write(text: str) -> None:
    """Print without breaking a tqdm bar."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(text, flush=True)
    else:
        tqdm.write(text)


class Monitor:
    """MFU and perplexity in the log records, TensorBoard scalars, text samples (rank 0)."""

    def __init__(self, args: argparse.Namespace, env: Any, model: nn.Module) -> None:
        self.args = args
        self.enabled = env.is_main
        self.model = model
        self.device = env.device
        self.world_size = env.world_size
        config = args.model_config
        self.flops_per_token = (
            train_step_flops(config, 1, args.context_length) / args.context_length
        )
        self.peak = peak_tflops(args, env.device)
        self.writer = None
        # every rank checks (and fails alike): one rank failing alone would hang the others
        self.tokenizer = self._check_tokenizer(args) if args.tokenizer is not None else None
        if not self.enabled:
            return
        for note in args.data_notes:
            _write(f"data: {note}")
        if args.log_dir is not None:
            self.writer = self._tensorboard(args.log_dir)

    @staticmethod
    def _check_tokenizer(args: argparse.Namespace) -> Any:
        """--tokenizer, refused when it cannot be the data's: more ids than the model, or
        another end-of-text id than the sidecar's."""
        from lm_core.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_file(args.tokenizer)
        vocab = args.model_config.vocab_size
        if tokenizer.vocab_size > vocab:
            raise ValueError(
                f"--tokenizer: its vocabulary ({tokenizer.vocab_size}) is larger than the "
                f"model's ({vocab})"
            )
        if args.eot_id is not None and tokenizer.eot_id != args.eot_id:
            raise ValueError(
                f"--tokenizer: its end-of-text id is {tokenizer.eot_id}, the data's sidecar "
                f"says {args.eot_id}: not the tokenizer the data was encoded with"
            )
        return tokenizer

    @staticmethod
    def _tensorboard(log_dir: Path) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _write(
                "--log-dir: tensorboard is not installed, writing metrics.jsonl only "
                "(`pip install 'lm-core[tensorboard]'` for TensorBoard events)"
            )
            return None
        return SummaryWriter(log_dir=str(log_dir))

    def log(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Add MFU (train records) or perplexity (validation records) to `entry`, write its
        scalars to TensorBoard; returns `entry`."""
        if "val_loss" in entry:
            entry["val_ppl"] = math.exp(min(entry["val_loss"], 700.0))
        if "tokens_per_s" in entry and self.peak is not None:
            achieved = entry["tokens_per_s"] * self.flops_per_token
            entry["mfu"] = achieved / (self.peak * 1e12 * self.world_size)
        if self.writer is not None and self.enabled:
            for key, value in entry.items():
                if key != "step" and isinstance(value, int | float):
                    group = "val" if key.startswith("val_") else "train"
                    self.writer.add_scalar(
                        f"{group}/{key.removeprefix('val_')}", value, entry["step"]
                    )
            self.writer.flush()
        return entry

    def sample_due(self, step: int) -> bool:
        return self.enabled and bool(self.args.sample_every) and step % self.args.sample_every == 0

    @torch.no_grad()
    def sample(self, step: int) -> str:
        """Generate a short text from the current weights and print it; returns the text.
        Uses its own generator (seeded by --seed and the step): training RNG is untouched."""
        from lm_core.generation import Decoder

        args, tok = self.args, self.tokenizer
        prompt = tok.encode(args.sample_prompt) if args.sample_prompt else []
        if not prompt:
            prompt = [tok.require_eot("--tokenizer")]
        context = args.model_config.context_length
        prompt = prompt[-(context - 1) :]
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(args.seed + step)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if args.bf16
            else torch.autocast(self.device.type, enabled=False)
        )
        n = min(args.sample_tokens, context - len(prompt))
        with autocast:
            out = Decoder(self.model, max_len=len(prompt) + n).generate(
                tokens,
                n,
                temperature=args.sample_temperature,
                eos_id=tok.eot_id,
                generator=generator,
            )
        text = args.sample_prompt + tok.decode(
            t for t in out[0, len(prompt) :].tolist() if t != tok.eot_id
        )
        if self.writer is not None:
            self.writer.add_text("sample", text, step)
        _write(f"sample at step {step}: {text!r}")
        return text

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
