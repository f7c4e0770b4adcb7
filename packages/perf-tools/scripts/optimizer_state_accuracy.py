"""Accuracy of lm_core's bf16 optimizer states (`AdamW(state_dtype=torch.bfloat16)`):
the same small model trained on real text with fp32 moments (the default) and with bf16
moments, same seed and same batches, and the loss curves compared.

The text is this repository's own Markdown documentation (`packages/*/README.md`,
`packages/*/DESIGN.md`, `packages/*/docs/*.md`, `README.md`; sorted, deterministic), as in the
working tree or at a commit (`--corpus-rev`, read with git: the same text whatever the docs say
today), tokenized
by a byte-level BPE of 512 tokens trained on it (lm_core.tokenizer, needs `tokenizers`), 10%
held out for validation. Each variant trains a fresh model from the same initialization on the same
sequence of batches with lm_core's AdamW (betas 0.9/0.95, weight decay 0.1, gradient
clipping 1.0, linear warmup then cosine decay: the trainer's defaults but the peak LR).
Variants: fp32 (the reference), bf16 with stochastic rounding (the default of bf16 states),
bf16 rounded to nearest, and fp32 from another initialization seed, the yardstick: a
difference smaller than a reseeded fp32 run's is noise at this scale.

Writes <out>/optimizer_state_accuracy.csv (per step: each variant's train loss; validation
loss at the eval steps), .json (config, corpus SHA-256, final and averaged differences),
.png (the curves and their differences from fp32). On CPU (the default, ~1 M parameters,
400 steps) it takes a few minutes:

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') \\
        python3 packages/perf-tools/scripts/optimizer_state_accuracy.py --out /tmp/acc
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[3]
# variant -> (state dtype, rounding, init seed offset)
VARIANTS = {
    "fp32": (torch.float32, "stochastic", 0),
    "bf16-stochastic": (torch.bfloat16, "stochastic", 0),
    "bf16-nearest": (torch.bfloat16, "nearest", 0),
    "fp32-reseeded": (torch.float32, "stochastic", 1),
}


def corpus_files(work: Path, rev: str | None) -> list[Path]:
    """The docs, from the working tree (rev None) or copied out of commit `rev` into `work`."""
    patterns = ("packages/*/README.md", "packages/*/DESIGN.md", "packages/*/docs/*.md")
    if rev is None:
        files = [f for pattern in patterns for f in sorted(REPO.glob(pattern))]
        return [*files, REPO / "README.md"]
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", rev],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    names = [n for pattern in patterns for n in sorted(n for n in listed if Path(n).match(pattern))]
    out = []
    for name in [*names, "README.md"]:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{name}"], capture_output=True, check=True
        ).stdout
        path = work / "corpus" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
        out.append(path)
    return out


def tokenize(files: list[Path], work: Path, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation token ids of `files` (lm_core's BPE + encoder)."""
    from lm_core.data import load_tokens
    from lm_core.encode import encode_files
    from lm_core.text_io import DOC_END, DocumentReader
    from lm_core.tokenizer import train_bpe

    pieces = (p for f in files for p in DocumentReader(f, blank_lines=True) if p is not DOC_END)
    tokenizer = train_bpe(pieces, vocab, show_progress=False)
    encode_files(tokenizer, files, work, val_fraction=0.1, blank_lines=True, progress=False)
    return load_tokens(work / "train.bin"), load_tokens(work / "val.bin")


def model_config(args: argparse.Namespace, vocab: int):
    """The tiny preset with the script's dimensions."""
    from lm_core import get_config

    return get_config(
        "tiny",
        vocab_size=vocab,
        context_length=args.context,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        d_ff=args.d_ff,
    )


def train(
    name: str,
    args: argparse.Namespace,
    train_ids: np.ndarray,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    vocab: int,
) -> tuple[list[float], dict[int, float]]:
    """Per-step train losses and {step: validation loss} of one variant."""
    from lm_core import AdamW, TransformerLM, clip_grad_norm, cosine_lr, cross_entropy
    from lm_core.data import get_batch

    state_dtype, rounding, seed_offset = VARIANTS[name]
    config = model_config(args, vocab)
    device = torch.device(args.device)
    torch.manual_seed(args.seed + seed_offset)
    model = TransformerLM(config).to(device)
    opt = AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, args.beta2),
        eps=1e-8,
        weight_decay=0.1,
        state_dtype=state_dtype,
        state_rounding=rounding,
    )
    gen = torch.Generator().manual_seed(args.seed)  # the same batches for every variant
    losses: list[float] = []
    val: dict[int, float] = {}
    warmup = args.steps // 20
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                val[step] = float(
                    np.mean([cross_entropy(model(x), y).item() for x, y in val_batches])
                )
            model.train()
        if step == args.steps:
            break
        lr = cosine_lr(step, args.lr, args.lr / 10, warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_ids, args.batch, args.context, device, gen)
        loss = cross_entropy(model(x), y)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, val


def summarize(curves: dict, vals: dict, last: int) -> dict:
    """Differences from the fp32 run: final validation loss, mean train loss of the last
    `last` steps (paired: the same batches), mean |difference| per step over the run."""
    ref, ref_val = np.array(curves["fp32"]), vals["fp32"]
    final = max(ref_val)
    out = {}
    for name, c in curves.items():
        c = np.array(c)
        out[name] = {
            "final_val_loss": vals[name][final],
            "final_val_minus_fp32": vals[name][final] - ref_val[final],
            f"mean_train_loss_last_{last}": float(c[-last:].mean()),
            f"mean_train_minus_fp32_last_{last}": float((c[-last:] - ref[-last:]).mean()),
            "mean_abs_train_diff_per_step": float(np.abs(c - ref).mean()),
        }
    return out


def plot(curves: dict, vals: dict, path: Path, title: str) -> None:
    """Loss curves; their differences from fp32; the bf16 variants' differences alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    colors = dict(zip(VARIANTS, ("C0", "C1", "C2", "C7")))
    ref = np.array(curves["fp32"])
    for name, c in curves.items():
        c, color = np.array(c), colors[name]
        steps = np.arange(1, len(c) + 1)
        vs = sorted(vals[name])
        axes[0].plot(steps, _smooth(c), color=color, lw=1.2, label=f"{name} (train, 20-step mean)")
        axes[0].plot(vs, [vals[name][s] for s in vs], "o", ms=3, color=color)
        if name == "fp32":
            continue
        for ax in axes[1:] if name.startswith("bf16") else axes[1:2]:
            ax.plot(steps, _smooth(c - ref), color=color, lw=1.2, label=name)
            ax.plot(vs, [vals[name][s] - vals["fp32"][s] for s in vs], "o", ms=3, color=color)
    axes[0].set_ylabel("loss (dots: validation)")
    axes[0].set_title(title, fontsize=10)
    axes[1].set_ylabel("loss - fp32 loss")
    axes[2].set_ylabel("loss - fp32 loss (bf16 only)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.legend(fontsize=8)
    for ax in axes[1:]:
        ax.axhline(0.0, color="k", lw=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _smooth(x: np.ndarray, k: int = 20) -> np.ndarray:
    c = np.cumsum(np.insert(x, 0, 0.0))
    return np.array([(c[i + 1] - c[max(0, i + 1 - k)]) / min(k, i + 1) for i in range(len(x))])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the CSV/JSON/PNG")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=384)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--corpus-rev", help="read the docs at this git commit (default: the files)")
    args = p.parse_args()
    if "fp32" not in args.variants:
        p.error("argument --variants: fp32 (the reference) must be one of them")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus_files(Path(tmp), args.corpus_rev)
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
        n_bytes = sum(f.stat().st_size for f in files)
        names = [str(f.relative_to(REPO if args.corpus_rev is None else Path(tmp) / "corpus"))
                 for f in files]  # fmt: skip
        train_ids, val_ids = tokenize(files, Path(tmp), args.vocab)
    vocab = int(max(train_ids.max(), val_ids.max())) + 1
    from lm_core.data import get_batch

    vgen = torch.Generator().manual_seed(12345)
    val_batches = [
        get_batch(val_ids, args.batch, args.context, args.device, vgen)
        for _ in range(args.val_batches)
    ]
    print(f"corpus: {len(files)} files, {n_bytes} bytes, sha256 {digest[:12]}; "
          f"{len(train_ids)} train / {len(val_ids)} val tokens")  # fmt: skip
    curves, vals, seconds = {}, {}, {}
    for name in args.variants:
        t0 = time.perf_counter()
        curves[name], vals[name] = train(name, args, train_ids, val_batches, vocab)
        seconds[name] = time.perf_counter() - t0
        final = vals[name][args.steps]
        print(f"{name:16s} final val loss {final:.4f}  ({seconds[name]:.0f} s)", flush=True)
        if not math.isfinite(final):
            return 1
    last = min(100, args.steps)
    summary = summarize(curves, vals, last)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "optimizer_state_accuracy"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(f"{n}_train" for n in curves), *(f"{n}_val" for n in curves)])
        for step in range(args.steps + 1):
            train_cols = [f"{curves[n][step - 1]:.6f}" if step else "" for n in curves]
            val_cols = [f"{vals[n][step]:.6f}" if step in vals[n] else "" for n in curves]
            w.writerow([step, *train_cols, *val_cols])
    from lm_core import TransformerLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in TransformerLM(model_config(args, vocab)).parameters())
    meta = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "params": n_params,
        "vocab": vocab,
        "corpus": {"rev": args.corpus_rev, "files": names, "bytes": n_bytes, "sha256": digest},
        "tokens": {"train": len(train_ids), "val": len(val_ids)},
        "torch": torch.__version__,
        "seconds": seconds,
        "summary": summary,
    }
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    title = (f"{n_params / 1e6:.2f} M params, {args.steps} steps x {args.batch}x{args.context} "
             f"tokens of the repo's docs, peak lr {args.lr}, betas (0.9, {args.beta2}), "
             f"{args.device}")  # fmt: skip
    plot(curves, vals, stem.with_suffix(".png"), title)
    for name, s in summary.items():
        print(f"{name:16s} " + ", ".join(f"{k} {v:+.4f}" for k, v in s.items()))
    print(f"wrote {stem}.csv / .json / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
