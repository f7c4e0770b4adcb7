"""`python -m lm_core.generate`: text from a checkpoint of `lm_core.train`, printed as it comes.

Example:
    python -m lm_core.generate --checkpoint runs/tiny/checkpoint.pt --tokenizer tokenizer.json \\
        --prompt "Once upon a time" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0

`--prompt` may be given several times: the prompts, of any lengths, run as one batch
(right-padded, `prompt_lengths`), each `--num-samples` times. The model is rebuilt from the
config stored in the checkpoint; `--tokenizer` defaults to the one
the run was given (`lm_core.train --tokenizer`). Generation stops at the end-of-text token unless
`--ignore-eot`. The same seed gives the same text on the same device and software. Needs
`pip install 'lm-core[text]'`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lm_core.checkpoint import checked_model_state, read_checkpoint
from lm_core.config import ATTENTION_BACKENDS, ModelConfig
from lm_core.generation import Decoder, cast_weights, check_sampling
from lm_core.model import TransformerLM
from lm_core.tokenizer import EOT_TOKEN, TextTokenizer
from lm_core.train_config import recorded_option

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lm_core.generate",
        description="Sample text from a checkpoint written by `python -m lm_core.train`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint.pt of a run")
    p.add_argument("--tokenizer", type=Path, help="tokenizer JSON [the run's --tokenizer]")
    p.add_argument(
        "--prompt",
        action="append",
        help="text to continue; repeat for a batch of prompts [none: a new document]",
    )
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample within the nucleus of probability p")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--num-samples", type=int, default=1, help="samples (one batch)")
    p.add_argument("--eot-token", default=EOT_TOKEN, help="the end-of-text token")
    p.add_argument("--ignore-eot", action="store_true", help="do not stop at end-of-text")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weights' dtype")
    p.add_argument("--attention", choices=list(ATTENTION_BACKENDS), help="attention backend")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--cuda-graph", action="store_true", help="replay the step as a CUDA graph")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; a bad value exits with an argparse error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.checkpoint.is_file():
        parser.error(f"--checkpoint: file not found: {args.checkpoint}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer: file not found: {args.tokenizer}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.num_samples < 1:
        parser.error(f"--num-samples must be positive, got {args.num_samples}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p, None, 1)
    except ValueError as exc:
        parser.error(str(exc).replace("top_k", "--top-k").replace("top_p", "--top-p"))
    args.device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.cuda_graph and args.device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    return args


def load_model(args: argparse.Namespace) -> tuple[TransformerLM, dict[str, Any]]:
    """The checkpoint's model on --device in --dtype, and what its run recorded: its
    `sample.tokenizer` and `data.eot_id` (None where not recorded)."""
    payload = read_checkpoint(args.checkpoint)
    if payload["config"] is None:
        raise ValueError(f"--checkpoint: {args.checkpoint} stores no model config")
    config = ModelConfig.from_dict(payload["config"])
    if args.attention is not None:
        config = ModelConfig.from_dict({**config.to_dict(), "attention": args.attention})
    with torch.device(args.device):
        model = TransformerLM(config)
    state = checked_model_state(payload, args.checkpoint, config, model.state_dict())
    model.load_state_dict(state)
    cast_weights(model, DTYPES[args.dtype])
    extra = payload.get("extra") or {}
    run = {key: recorded_option(extra, key) for key in ("sample.tokenizer", "data.eot_id")}
    return model, run


def load_tokenizer(args: argparse.Namespace, run: dict[str, Any], vocab: int) -> TextTokenizer:
    """--tokenizer, or the run's; checked against the model's vocabulary and eot id. `run`:
    the run's `sample.tokenizer` and `data.eot_id` (`load_model`)."""
    path = args.tokenizer
    if path is None:
        recorded = run.get("sample.tokenizer")
        if not recorded:
            raise ValueError("--tokenizer: required (the checkpoint's run names no tokenizer)")
        path = Path(recorded)
        if not path.is_file():
            raise ValueError(f"--tokenizer: the run's tokenizer {path} is gone; pass one")
    tokenizer = TextTokenizer.from_file(path, args.eot_token)
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"--tokenizer: {path} has {tokenizer.vocab_size} ids, the model only {vocab}"
        )
    trained_eot = run.get("data.eot_id")
    if trained_eot is not None and tokenizer.eot_id != trained_eot:
        raise ValueError(
            f"--tokenizer: {path} gives {args.eot_token} id {tokenizer.eot_id}, but the run's "
            f"data used {trained_eot}: not the tokenizer the model was trained with"
        )
    return tokenizer


class _TextStream:
    """Prints the text of a growing id list as it becomes whole UTF-8 characters."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character's bytes are still arriving
            return
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        sys.stdout.write(text[len(self.shown) :] + "\n")
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model, run = load_model(args)
    config = model.config
    tokenizer = load_tokenizer(args, run, config.vocab_size)
    eot = None if args.ignore_eot else tokenizer.eot_id
    texts = args.prompt or [""]
    prompts = [tokenizer.encode(t) if t else [tokenizer.require_eot()] for t in texts]
    width = max(len(p) for p in prompts)
    room = config.context_length - width
    if args.max_new_tokens > room:
        raise ValueError(
            f"--max-new-tokens: the longest prompt ({width} tokens) leaves room for {room} "
            f"in the model's context_length {config.context_length}"
        )
    decoder = Decoder(
        model, max_len=width + args.max_new_tokens, compile=args.compile,
        cuda_graph=args.cuda_graph,
    )  # fmt: skip
    rows = [p + [0] * (width - len(p)) for p in prompts for _ in range(args.num_samples)]
    lengths = [len(p) for p in prompts for _ in range(args.num_samples)]
    tokens = torch.tensor(rows, dtype=torch.long, device=args.device)
    ragged = None if len(set(lengths)) == 1 else lengths
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    sampling = (args.temperature, args.top_k, args.top_p, eot, generator)
    t0 = time.perf_counter()
    n = 0
    if len(rows) == 1:
        out = _TextStream(tokenizer)
        sys.stdout.write(texts[0])
        for step in decoder.stream(tokens, args.max_new_tokens, *sampling):
            n += 1
            if eot is not None and int(step[0]) == eot:
                break
            out.add(int(step[0]))
        out.finish()
    else:
        out_rows = decoder.generate(tokens, args.max_new_tokens, *sampling, ragged).tolist()
        n = len(out_rows[0]) - width
        for i, (row, length) in enumerate(zip(out_rows, lengths)):
            new = row[length : length + n]
            ids = new[: new.index(eot)] if eot is not None and eot in new else new
            prompt_i, sample = divmod(i, args.num_samples)
            head = f"--- sample {sample} ---" if len(texts) == 1 else (
                f"--- prompt {prompt_i}, sample {sample} ---"
            )  # fmt: skip
            print(f"{head}\n{texts[prompt_i]}{tokenizer.decode(ids)}")
    seconds = time.perf_counter() - t0
    print(
        f"[{n} steps x {len(rows)} in {seconds:.2f} s: {n * len(rows) / seconds:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and generate; returns the exit status."""
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, ImportError, RuntimeError) as exc:
        print(f"python -m lm_core.generate: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
