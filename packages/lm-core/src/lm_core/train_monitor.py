"""What the trainer reports beside the loss: MFU, validation perplexity, TensorBoard events, text
samples, and what the token files' sidecars gave the model (vocabulary, end-of-text id: applied
by `lm_core.train_checks.resolve_config`). Options: `TrainConfig.logging` and `.sample`.
`Monitor` is built by the trainer on every rank and acts on rank 0 only.

MFU = tokens/s x FLOPs per token (`lm_core.flops.train_step_flops`: forward + backward, no
recomputation) / (peak FLOP/s x ranks). The peak is `--peak-tflops`, else the datasheet rate of
a known GPU for the run's precision (bf16 with `--bf16`, TF32 with `--tf32`, else fp32); on
other devices MFU is left out of the log.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lm_core.flops import train_step_flops
from lm_core.train_checks import sidecar_notes
from lm_core.train_config import TrainConfig

# Dense tensor-core / FMA peaks of the SXM parts, TFLOP/s (datasheets). `tf32` applies when
# TF32 matmuls are allowed; `fp32` is plain IEEE fp32 on the CUDA cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def peak_tflops(config: TrainConfig, device: torch.device) -> float | None:
    """logging.peak_tflops, else the table's rate for this GPU and precision, else None."""
    if config.logging.peak_tflops is not None:
        return config.logging.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    t = config.training
    precision = "bf16" if t.bf16 else "tf32" if t.tf32 else "fp32"
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

    def __init__(self, config: TrainConfig, env: Any, model: nn.Module) -> None:
        """`config`: resolved (`resolve_config`)."""
        self.sample_opts = config.sample
        self.seed = config.training.seed
        self.bf16 = config.training.bf16
        self.enabled = env.is_main
        self.model = model
        self.device = env.device
        self.world_size = env.world_size
        self.model_config = config.model_config
        seq = config.model.context_length
        self.flops_per_token = train_step_flops(self.model_config, 1, seq) / seq
        self.peak = peak_tflops(config, env.device)
        self.writer = None
        # every rank checks (and fails alike): one rank failing alone would hang the others
        self.tokenizer = self._check_tokenizer(config) if config.sample.tokenizer else None
        if not self.enabled:
            return
        for note in sidecar_notes(config):
            _write(f"data: {note}")
        if config.logging.log_dir is not None:
            self.writer = self._tensorboard(config.logging.log_dir)

    @staticmethod
    def _check_tokenizer(config: TrainConfig) -> Any:
        """sample.tokenizer, refused when it cannot be the data's: more ids than the model,
        or another end-of-text id than the sidecar's."""
        from lm_core.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_file(config.sample.tokenizer)
        vocab, eot = config.model_config.vocab_size, config.data.eot_id
        if tokenizer.vocab_size > vocab:
            raise ValueError(
                f"--tokenizer (sample.tokenizer): its vocabulary ({tokenizer.vocab_size}) is "
                f"larger than the model's ({vocab})"
            )
        if eot is not None and tokenizer.eot_id != eot:
            raise ValueError(
                f"--tokenizer (sample.tokenizer): its end-of-text id is {tokenizer.eot_id}, the "
                f"data's sidecar says {eot}: not the tokenizer the data was encoded with"
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
        every = self.sample_opts.every
        return self.enabled and bool(every) and step % every == 0

    @torch.no_grad()
    def sample(self, step: int) -> str:
        """Generate a short text from the current weights and print it; returns the text.
        Uses its own generator (seeded by training.seed and the step): training RNG is
        untouched."""
        from lm_core.generation import Decoder

        opts, tok = self.sample_opts, self.tokenizer
        prompt = tok.encode(opts.prompt) if opts.prompt else []
        if not prompt:
            prompt = [tok.require_eot("--tokenizer")]
        context = self.model_config.context_length
        prompt = prompt[-(context - 1) :]
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.seed + step)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.bf16
            else torch.autocast(self.device.type, enabled=False)
        )
        n = min(opts.tokens, context - len(prompt))
        with autocast:
            out = Decoder(self.model, max_len=len(prompt) + n).generate(
                tokens,
                n,
                temperature=opts.temperature,
                eos_id=tok.eot_id,
                generator=generator,
            )
        text = opts.prompt + tok.decode(
            t for t in out[0, len(prompt) :].tolist() if t != tok.eot_id
        )
        if self.writer is not None:
            self.writer.add_text("sample", text, step)
        _write(f"sample at step {step}: {text!r}")
        return text

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
