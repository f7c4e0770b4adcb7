"""`python -m lm_core.generate`: text from a checkpoint of `lm_core.train`, printed as it comes.

Example:
    python -m lm_core.generate --checkpoint runs/tiny/checkpoint.pt --tokenizer tokenizer.json \\
        --prompt "Once upon a time" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0

`--prompt` may be given several times: the prompts, of any lengths, run as one batch
(right-padded, `prompt_lengths`), each `--num-samples` times. The model is rebuilt from the
config stored in the checkpoint; `--tokenizer` defaults to the one
the run was given (`lm_core.train --tokenizer`). Generation stops at the end-of-text token unless
`--ignore-eot`. The same seed gives the same text on the same device and software. Needs
`pip install 'lm-core[text]'`. From Python: `run(GenerateConfig(checkpoint=path,
prompts=("Once upon a time",)))`, the flags as the fields of `GenerateConfig`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_core._cli import as_field, as_flag
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


@dataclass(frozen=True)
class GenerateConfig:
    """What one generation run does: the flags of `python -m lm_core.generate`, typed.

    Checked when made: a bad value is a ValueError naming the field (`max_new_tokens`), a
    missing file included. `device` may be given as a string ("auto": cuda when available,
    else cpu); it is held as the `torch.device` it names.
    """

    checkpoint: Path
    tokenizer: Path | None = None  # None: the one the checkpoint's run recorded
    prompts: tuple[str, ...] = ()  # one batch; none: a new document
    max_new_tokens: int = 200
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    num_samples: int = 1  # per prompt
    eot_token: str = EOT_TOKEN
    ignore_eot: bool = False
    device: torch.device | str = "auto"
    dtype: str = "fp32"  # a key of DTYPES: the weights' dtype
    attention: str | None = None  # None: the checkpoint's backend
    compile: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize the fields once, here
        set_(self, "checkpoint", Path(self.checkpoint))
        if self.tokenizer is not None:
            set_(self, "tokenizer", Path(self.tokenizer))
        if isinstance(self.prompts, str):  # tuple("text") would be its characters
            raise ValueError(f"prompts: expected a sequence of strings, got {self.prompts!r}")
        set_(self, "prompts", tuple(self.prompts))
        _check(vars(self), as_field)
        set_(self, "device", _device(self.device))


def _device(spec: torch.device | str) -> torch.device:
    """`spec` as a torch.device; "auto": cuda when available, else cpu."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def _check(c: Mapping[str, Any], name: Callable[[str], str]) -> None:
    """ValueError for the first bad value of a GenerateConfig's fields `c`; `name` says how
    to call a field (`as_field`, or the CLI's `as_flag`), so one set of checks serves both."""
    if not c["checkpoint"].is_file():
        raise ValueError(f"{name('checkpoint')}: file not found: {c['checkpoint']}")
    if c["tokenizer"] is not None and not c["tokenizer"].is_file():
        raise ValueError(f"{name('tokenizer')}: file not found: {c['tokenizer']}")
    if c["max_new_tokens"] < 1:
        raise ValueError(f"{name('max_new_tokens')} must be positive, got {c['max_new_tokens']}")
    if c["num_samples"] < 1:
        raise ValueError(f"{name('num_samples')} must be positive, got {c['num_samples']}")
    try:
        check_sampling(c["temperature"], c["top_k"], c["top_p"], None, 1)
    except ValueError as exc:  # check_sampling names its arguments as the fields are named
        message = str(exc).replace("top_k", name("top_k")).replace("top_p", name("top_p"))
        raise ValueError(message) from None
    device = _device(c["device"])  # a bad string: torch's RuntimeError, as it always was
    if c["cuda_graph"] and device.type != "cuda":
        raise ValueError(f"{name('cuda_graph')} needs a CUDA device, got {name('device')} {device}")
    if c["dtype"] not in DTYPES:
        raise ValueError(f"{name('dtype')}: expected one of {list(DTYPES)}, got {c['dtype']!r}")
    if c["attention"] is not None and c["attention"] not in ATTENTION_BACKENDS:
        raise ValueError(
            f"{name('attention')}: expected one of {list(ATTENTION_BACKENDS)}, "
            f"got {c['attention']!r}"
        )


def config_from_args(ns: argparse.Namespace) -> GenerateConfig:
    """The GenerateConfig of parsed flags; a bad value is a ValueError naming the flag."""
    fields = {
        "checkpoint": ns.checkpoint,
        "tokenizer": ns.tokenizer,
        "prompts": tuple(ns.prompt or ()),
        "max_new_tokens": ns.max_new_tokens,
        "temperature": ns.temperature,
        "top_k": ns.top_k,
        "top_p": ns.top_p,
        "seed": ns.seed,
        "num_samples": ns.num_samples,
        "eot_token": ns.eot_token,
        "ignore_eot": ns.ignore_eot,
        "device": ns.device,
        "dtype": ns.dtype,
        "attention": ns.attention,
        "compile": ns.compile,
        "cuda_graph": ns.cuda_graph,
    }
    _check(fields, as_flag)  # first, so that the error names the flag, not the field
    return GenerateConfig(**fields)


def parse_args(argv: Sequence[str] | None = None) -> GenerateConfig:
    """The GenerateConfig of a command line; a bad value exits with an argparse error naming
    the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return config_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))


def load_model(cfg: GenerateConfig) -> tuple[TransformerLM, dict[str, Any]]:
    """The checkpoint's model on `cfg.device` in `cfg.dtype`, and what its run
    recorded: its `sample.tokenizer` and `data.eot_id` (None where not recorded)."""
    payload = read_checkpoint(cfg.checkpoint)
    if payload["config"] is None:
        raise ValueError(f"--checkpoint: {cfg.checkpoint} stores no model config")
    config = ModelConfig.from_dict(payload["config"])
    if cfg.attention is not None:
        config = ModelConfig.from_dict({**config.to_dict(), "attention": cfg.attention})
    with torch.device(cfg.device):
        model = TransformerLM(config)
    state = checked_model_state(payload, cfg.checkpoint, config, model.state_dict())
    model.load_state_dict(state)
    cast_weights(model, DTYPES[cfg.dtype])
    extra = payload.get("extra") or {}
    run = {key: recorded_option(extra, key) for key in ("sample.tokenizer", "data.eot_id")}
    return model, run


def load_tokenizer(cfg: GenerateConfig, run: dict[str, Any], vocab: int) -> TextTokenizer:
    """`cfg.tokenizer`, or the run's; checked against the model's vocabulary and eot id.
    `run`: the run's `sample.tokenizer` and `data.eot_id` (`load_model`)."""
    path = cfg.tokenizer
    if path is None:
        recorded = run.get("sample.tokenizer")
        if not recorded:
            raise ValueError("--tokenizer: required (the checkpoint's run names no tokenizer)")
        path = Path(recorded)
        if not path.is_file():
            raise ValueError(f"--tokenizer: the run's tokenizer {path} is gone; pass one")
    tokenizer = TextTokenizer.from_file(path, cfg.eot_token)
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"--tokenizer: {path} has {tokenizer.vocab_size} ids, the model only {vocab}"
        )
    trained_eot = run.get("data.eot_id")
    if trained_eot is not None and tokenizer.eot_id != trained_eot:
        raise ValueError(
            f"--tokenizer: {path} gives {cfg.eot_token} id {tokenizer.eot_id}, but the run's "
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


def run(cfg: GenerateConfig) -> int:
    """Generate as `cfg` says, printing the text (streamed for a single sample) and, on
    stderr, the speed; returns the exit status."""
    torch.manual_seed(cfg.seed)
    model, run = load_model(cfg)
    config = model.config
    tokenizer = load_tokenizer(cfg, run, config.vocab_size)
    eot = None if cfg.ignore_eot else tokenizer.eot_id
    texts = list(cfg.prompts) or [""]
    prompts = [tokenizer.encode(t) if t else [tokenizer.require_eot()] for t in texts]
    width = max(len(p) for p in prompts)
    room = config.context_length - width
    if cfg.max_new_tokens > room:
        raise ValueError(
            f"--max-new-tokens: the longest prompt ({width} tokens) leaves room for {room} "
            f"in the model's context_length {config.context_length}"
        )
    decoder = Decoder(
        model, max_len=width + cfg.max_new_tokens, compile=cfg.compile,
        cuda_graph=cfg.cuda_graph,
    )  # fmt: skip
    rows = [p + [0] * (width - len(p)) for p in prompts for _ in range(cfg.num_samples)]
    lengths = [len(p) for p in prompts for _ in range(cfg.num_samples)]
    tokens = torch.tensor(rows, dtype=torch.long, device=cfg.device)
    ragged = None if len(set(lengths)) == 1 else lengths
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    sampling = (cfg.temperature, cfg.top_k, cfg.top_p, eot, generator)
    t0 = time.perf_counter()
    n = 0
    if len(rows) == 1:
        out = _TextStream(tokenizer)
        sys.stdout.write(texts[0])
        for step in decoder.stream(tokens, cfg.max_new_tokens, *sampling):
            n += 1
            if eot is not None and int(step[0]) == eot:
                break
            out.add(int(step[0]))
        out.finish()
    else:
        out_rows = decoder.generate(tokens, cfg.max_new_tokens, *sampling, ragged).tolist()
        n = len(out_rows[0]) - width
        for i, (row, length) in enumerate(zip(out_rows, lengths)):
            new = row[length : length + n]
            ids = new[: new.index(eot)] if eot is not None and eot in new else new
            prompt_i, sample = divmod(i, cfg.num_samples)
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
    cfg = parse_args(argv)  # the one place flags become a GenerateConfig
    try:
        return run(cfg)
    except (ValueError, OSError, ImportError, RuntimeError) as exc:
        print(f"python -m lm_core.generate: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
