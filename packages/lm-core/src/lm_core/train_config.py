"""The trainer's typed configuration: `TrainConfig`, one dataclass section per concern.

Every field is one option of `python -m lm_core.train`: its flag is `--` + the field name with
dashes (`optim.max_lr` -> `--max-lr`) unless the field names another (`data.path` -> `--data`),
and its doc is the flag's `--help` text. A TOML file holds the same keys, a table per section:

    [model]
    size = "tiny"
    context_length = 32

    [optim]
    max_lr = 3e-3

`TrainConfig.from_toml(path)` reads one, strictly: an unknown key, a value of the wrong type or
outside a field's choices is a `ConfigError` naming the key. `to_dict()` and `to_toml()` write
one back (fields that are None, meaning "derived" or "off", are left out of TOML, which has no
null). Checks that span fields or read files (token sidecars, an earlier run in the output
directory) live in `lm_core.train_checks.resolve_config`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from lm_core.config import ATTENTION_BACKENDS, MATMUL_BACKENDS, MODEL_SIZES, ModelConfig, get_config

DdpKind = Literal["none", "naive", "flat", "individual", "bucketed", "torch"]
FsdpKind = Literal["none", "ours", "torch"]


class ConfigError(ValueError):
    """An invalid training option; `key` is its dotted name (`optim.max_lr`)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _opt(default: Any, doc: str, *, flag: str | None = None, **meta: Any) -> Any:
    """A field with its doc (the `--help` text) and CLI flag. `meta`: `choices` for str
    fields whose names live in a registry, `metavar` for the help."""
    return field(default=default, metadata={"doc": doc, "flag": flag, **meta})


@dataclass
class ModelOptions:
    """model: a preset of MODEL_SIZES; fields that are set replace the preset's."""

    size: str = _opt("tiny", "preset", choices=tuple(MODEL_SIZES))
    vocab_size: int | None = _opt(
        None, "override the preset's vocab_size [the --data sidecar's, else the preset's]"
    )
    context_length: int | None = _opt(None, "sequence length trained on (and the maximum)")
    d_model: int | None = _opt(None, "override d_model")
    num_layers: int | None = _opt(None, "override num_layers")
    num_heads: int | None = _opt(None, "override num_heads")
    d_ff: int | None = _opt(None, "override d_ff")
    rope_theta: float | None = _opt(None, "override rope_theta")
    attention: str | None = _opt(None, "attention backend", choices=ATTENTION_BACKENDS)
    num_kv_heads: int | None = _opt(None, "k/v heads, dividing num_heads (grouped-query)")
    sliding_window: int | None = _opt(None, "attend to the last N tokens only (and itself)")
    matmul: str | None = _opt(
        None,
        "fp32 linear layers: default (torch) or tf32x3 (fp32-accurate, TF32 tensor cores; "
        "fastest with --compile and CUDA graphs)",
        choices=MATMUL_BACKENDS,
    )


@dataclass
class DataOptions:
    """data: token files, or a synthetic stream when there are none."""

    path: Path | None = _opt(
        None, "training tokens (.npy, or raw .bin of --data-dtype)", flag="--data"
    )
    val_path: Path | None = _opt(None, "validation tokens (same formats)", flag="--val-data")
    dtype: str | None = _opt(
        None,
        "dtype of raw .bin token files [their JSON sidecar's, else uint16]",
        flag="--data-dtype",
    )
    synthetic: Literal["pattern", "random"] = _opt(
        "pattern", "synthetic tokens without --data (pattern: learnable; random: benchmark)"
    )
    synthetic_tokens: int = _opt(200_000, "synthetic stream size")
    pack_documents: bool = _opt(
        False,
        "attend within documents only: each window is split at every --eot-id token "
        "(lm_core.data.document_offsets) and the model gets the offsets (cu_seqlens)",
    )
    eot_id: int | None = _opt(
        None, "end-of-text token id, for --pack-documents [the --data sidecar's]"
    )


@dataclass
class TrainingOptions:
    """training: steps, batch, precision, memory, device."""

    steps: int = _opt(100, "optimizer steps in total")
    batch_size: int = _opt(8, "global sequences per micro-step (split evenly over ranks)")
    grad_accum_steps: int = _opt(1, "micro-steps per optimizer step")
    seed: int = _opt(0, "seeds the weights, the data order and the samples")
    device: str = _opt("auto", "auto, cpu, cuda, cuda:1, ...")
    bf16: bool = _opt(False, "bf16 autocast (weights stay fp32)")
    bf16_weights: bool = _opt(
        False,
        "with --bf16: hold the blocks' linear weights in bf16 and their fp32 masters in AdamW, "
        "so no step casts them (the same math; one process, no accumulation, the full "
        "checkpoint format; lm_core.lowp_weights)",
    )
    tf32: bool = _opt(False, "allow TF32 matmuls on CUDA")
    compile: bool = _opt(False, "torch.compile the model")
    compile_blocks: bool = _opt(
        False,
        "torch.compile each Transformer block on its own instead of the whole model "
        "(lm_core.compile_blocks): one backward node per block, which --optimizer-overlap "
        "needs to step blocks during the backward",
    )
    optimizer_overlap: bool = _opt(
        False,
        "step each block's AdamW during the backward, on a side CUDA stream, as soon as its "
        "gradients are final (lm_core.OverlappedOptimizer; the same math; one process, "
        "--grad-clip 0, the full checkpoint format)",
    )
    cuda_graph: bool = _opt(
        False,
        "capture the whole step (forward, backward, clipping, AdamW, the LR) in one CUDA graph "
        "after 3 eager steps and replay it (one GPU; lm_core.graph_step)",
    )
    backward_thread: Literal["device", "calling"] | None = _opt(
        None,
        "where autograd runs the backward of CUDA tensors: device (its per-device thread) or "
        "calling (the training loop's thread; torch.autograd.set_multithreading_enabled(False)); "
        "a host-bound step can gain or lose by it: measure with perf_tools.bench "
        "--autograd-threads on off [as torch is set: device]",
    )
    activation_checkpointing: str | int = _opt(
        "none",
        "checkpoint groups of K consecutive blocks; sqrt: K = ceil(sqrt(layers)); "
        "optimal: the K that minimizes stored activations (lm_core.activation_ckpt)",
        metavar="{none,sqrt,optimal,K}",
    )
    fused_loss: bool = _opt(
        False, "fused LM head + cross-entropy: no (batch, seq, vocab) logits in memory"
    )


@dataclass
class OptimOptions:
    """optim: AdamW and its cosine learning-rate schedule."""

    max_lr: float = _opt(1e-3, "peak learning rate")
    min_lr: float | None = _opt(None, "final learning rate [max_lr / 10]")
    warmup_steps: int = _opt(0, "linear warmup steps")
    cosine_steps: int | None = _opt(None, "step where the cosine decay ends [steps]")
    weight_decay: float = _opt(0.1, "AdamW weight decay")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon", flag="--adam-eps")
    state_dtype: Literal["fp32", "bf16"] = _opt(
        "fp32",
        "dtype of AdamW's moments (weights stay fp32): bf16 halves the optimizer state and "
        "its traffic on CUDA, changing the numerics (stochastic rounding; lm_core.optim_lowp)",
        flag="--optimizer-state-dtype",
    )
    grad_clip: float = _opt(1.0, "max gradient L2 norm (0: off)")


@dataclass
class ParallelOptions:
    """parallel: data-parallel wrappers, sharding, tensor parallelism (run under torchrun)."""

    ddp: DdpKind = _opt("none", "gradient synchronization wrapper")
    bucket_size_mb: float = _opt(25.0, "bucket size of --ddp bucketed / torch")
    reduce_dtype: Literal["none", "bf16", "fp16"] = _opt(
        "none",
        "gradients sent by --ddp in this dtype (half the bytes; the average is rounded to it): "
        "ddp_kit's reduce_dtype, torch DDP's compress hook (NCCL only)",
        flag="--ddp-reduce-dtype",
    )
    zero: bool = _opt(False, "shard optimizer state (zero_shard)")
    fsdp: FsdpKind = _opt(
        "none",
        "shard weights, gradients and optimizer state: ours = zero_shard.FSDP, torch = torch's "
        "fully_shard (per block, then the root); excludes --ddp and --zero",
    )
    tp: int = _opt(
        1,
        "tensor parallel degree: shard attention heads and the SwiGLU over groups of N "
        "consecutive ranks (lm_core.parallel); with --fsdp torch, 2-D on a (ranks/N, N) mesh",
    )
    sequence_parallel: bool = _opt(
        False, "with --tp: norms and the residual stream split along the sequence"
    )
    backend: Literal["auto", "nccl", "gloo"] = _opt(
        "auto", "process group backend", flag="--dist-backend"
    )


@dataclass
class CheckpointOptions:
    """checkpoint: where the run's files go, how often it saves, what it resumes."""

    out_dir: Path | None = _opt(None, "checkpoint.pt and metrics.jsonl go here")
    every: int = _opt(0, "steps between checkpoints (0: at the end only)", flag="--ckpt-every")
    resume: Path | None = _opt(
        None, "checkpoint to resume from: a checkpoint.pt file or a sharded .dcp directory"
    )
    overwrite: bool = _opt(
        False,
        "start over in an --out-dir that holds a run: its checkpoint is replaced at the first "
        "save, its metrics log restarts (without it the trainer refuses)",
    )
    format: Literal["full", "dcp"] | None = _opt(
        None,
        "full: one file (checkpoint.pt), gathered to rank 0; dcp: a directory "
        "(checkpoint.dcp) every rank writes its own shards to (so on a filesystem every host "
        "mounts: checked at start), loadable at any world size "
        "(torch.distributed.checkpoint) [dcp with --fsdp or --zero, else full]",
        flag="--checkpoint-format",
    )


@dataclass
class EvalOptions:
    """eval: validation loss on --val-data (or the synthetic validation stream)."""

    every: int = _opt(0, "steps between evaluations (0: off)", flag="--eval-every")
    batches: int = _opt(4, "global batches per evaluation", flag="--eval-batches")


@dataclass
class LoggingOptions:
    """logging: metrics log, progress bar, TensorBoard, MFU."""

    every: int = _opt(10, "steps between log lines", flag="--log-every")
    metrics: Path | None = _opt(None, "metrics JSONL [log_dir/, else out_dir/metrics.jsonl]")
    progress: bool = _opt(True, "progress bar (tqdm)")
    log_dir: Path | None = _opt(
        None, "TensorBoard events (if tensorboard is installed) and metrics.jsonl"
    )
    peak_tflops: float | None = _opt(
        None, "peak TFLOP/s per device for MFU [datasheet value of a known GPU]"
    )


@dataclass
class SampleOptions:
    """sample: text printed from the current weights during training."""

    tokenizer: Path | None = _opt(None, "tokenizer JSON, for --sample-every")
    every: int = _opt(
        0, "steps between printed samples (0: off; needs --tokenizer)", flag="--sample-every"
    )
    tokens: int = _opt(64, "tokens per sample", flag="--sample-tokens")
    prompt: str = _opt(
        "", "prompt of the samples [empty: start a new document]", flag="--sample-prompt"
    )
    temperature: float = _opt(0.8, "sampling temperature", flag="--sample-temperature")


@dataclass
class TrainConfig:
    """Everything `python -m lm_core.train` takes, by section (`TrainConfig().optim.max_lr`).

    Build one in Python (`TrainConfig(optim=OptimOptions(max_lr=3e-3))`), from a TOML file
    (`from_toml`) or a dict (`from_dict`); `lm_core.train.run(config)` validates and trains.
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    sample: SampleOptions = field(default_factory=SampleOptions)

    @property
    def model_config(self) -> ModelConfig:
        """The model: the preset `model.size` with the `model` fields that are set."""
        opts = self.model
        overrides = {
            f.name: getattr(opts, f.name)
            for f in dataclasses.fields(opts)
            if f.name != "size" and getattr(opts, f.name) is not None
        }
        return get_config(opts.size, **overrides)

    @property
    def metrics_path(self) -> Path | None:
        """Where the metrics log goes: logging.metrics, else log_dir / metrics.jsonl, else
        out_dir / metrics.jsonl, else nowhere (None)."""
        if self.logging.metrics is not None:
            return self.logging.metrics
        folder = self.logging.log_dir or self.checkpoint.out_dir
        return folder / "metrics.jsonl" if folder is not None else None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {key: value}}: plain Python values (paths as str, None kept)."""
        return {
            s.name: {
                f.name: _plain(getattr(getattr(self, s.name), f.name))
                for f in dataclasses.fields(getattr(self, s.name))
            }
            for s in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | Path | None = None) -> TrainConfig:
        """A config from {section: {key: value}}; missing keys keep their defaults.

        Raises ConfigError naming the key (prefixed by `source`, e.g. the file) for an unknown
        section or key and for a value of the wrong type or outside the field's choices.
        """
        prefix = f"{source}: " if source is not None else ""
        if not isinstance(data, dict):
            raise ConfigError("", f"{prefix}expected a table of sections, got {data!r}")
        overrides: dict[str, Any] = {}
        for section, table in data.items():
            if section not in SECTIONS:
                raise ConfigError(
                    section, f"{prefix}{section}: {_unknown(section, SECTIONS, 'section')}"
                )
            if not isinstance(table, dict):
                raise ConfigError(section, f"{prefix}{section}: expected a table, got {table!r}")
            overrides.update({f"{section}.{key}": value for key, value in table.items()})
        return cls().with_overrides(overrides, source)

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        """Read a TOML file of the `to_toml` layout (see `from_dict` for the errors; a file
        that is missing or not TOML is a ConfigError too)."""
        return cls.from_dict(read_toml(path), source=path)

    def to_toml(self) -> str:
        """The config as TOML text that `from_toml` reads back to an equal config."""
        lines: list[str] = []
        for section, table in self.to_dict().items():
            lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
            lines += [f"{key} = {_toml_value(v)}" for key, v in table.items() if v is not None]
        return "\n".join(lines) + "\n"

    def with_overrides(
        self, overrides: dict[str, Any], source: str | Path | None = None
    ) -> TrainConfig:
        """A copy with dotted keys replaced (`{"optim.max_lr": 3e-3}`), each value checked
        against its field's type and converted (ConfigError naming the key; `source`
        prefixes the message)."""
        prefix = f"{source}: " if source is not None else ""
        new = copy.deepcopy(self)
        for key, value in overrides.items():
            section, _, name = key.partition(".")
            if section not in SECTIONS:
                raise ConfigError(key, f"{prefix}{key}: {_unknown(section, SECTIONS, 'section')}")
            names = {f.name for f in dataclasses.fields(SECTIONS[section])}
            if name not in names:
                raise ConfigError(key, f"{prefix}{key}: {_unknown(name, names)}")
            checked = _checked(key, _hints(SECTIONS[section])[name], value, prefix)
            setattr(getattr(new, section), name, checked)
        return new

    def checked(self) -> TrainConfig:
        """A copy with every value checked against its field's type and converted (a str
        to a Path, an int to a float): fields assigned in Python are checked here (`run`
        calls it). Raises ConfigError naming the first wrong field."""
        for section, cls in SECTIONS.items():
            value = getattr(self, section)
            if not isinstance(value, cls):
                raise ConfigError(section, f"{section}: expected a {cls.__name__}, got {value!r}")
        return self.with_overrides({key: value for key, _, value in iter_options(self)})


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(TrainConfig)
}


def iter_options(config: TrainConfig) -> typing.Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every option, in section order."""
    for section in SECTIONS:
        opts = getattr(config, section)
        for f in dataclasses.fields(opts):
            yield f"{section}.{f.name}", f, getattr(opts, f.name)


def option_field(key: str) -> dataclasses.Field:
    """The dataclass field of a dotted key."""
    section, _, name = key.partition(".")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def flag_of(key: str) -> str:
    """The CLI flag of a dotted key: `optim.max_lr` -> `--max-lr`, `data.path` -> `--data`."""
    f = option_field(key)
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


# Key of `TrainConfig.to_dict()` in a checkpoint's `extra`; checkpoints written before the
# config existed hold a flat record of the flags under "args" (keyed like `--eot-id` -> eot_id).
RUN_RECORD = "train_config"
_FLAG_RECORD = "args"


def recorded_option(extra: dict[str, Any], key: str) -> Any:
    """One option (dotted key, e.g. `sample.tokenizer`) of the run that wrote a checkpoint,
    from its payload's `extra`, in either record format; None when it is not recorded."""
    record = extra.get(RUN_RECORD)
    if isinstance(record, dict):
        section, _, name = key.partition(".")
        table = record.get(section)
        return table.get(name) if isinstance(table, dict) else None
    flags = extra.get(_FLAG_RECORD)
    if isinstance(flags, dict):
        return flags.get(flag_of(key).removeprefix("--").replace("-", "_"))
    return None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML file; ConfigError naming the file when it is missing or not TOML."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the stdlib has no TOML reader before 3.11: its backport
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("", f"{path}: file not found") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"{path}: not a readable TOML file: {exc}") from None


@dataclass(frozen=True)
class KeyNames:
    """How errors name an option: by its key (`optim.max_lr`), or by its flag (`--max-lr`)
    where `flags` is true and the value did not come from a file (`from_file` keys)."""

    flags: bool = False
    from_file: frozenset[str] = frozenset()

    def __call__(self, key: str) -> str:
        return flag_of(key) if self.flags and key not in self.from_file else key

    def setting(self, key: str, value: Any) -> str:
        """An option and its value as the user wrote it: `--fsdp ours`, `parallel.fsdp = "ours"`."""
        if self.flags and key not in self.from_file:
            return flag_of(key) if value is True else f"{flag_of(key)} {value}"
        return f"{key} = {_toml_value(_plain(value))}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown(name: str, known: typing.Iterable[str], what: str = "key") -> str:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {what}; {hint}expected one of {known}"


_TYPE_NAMES = {bool: "true or false", int: "an int", float: "a number", str: "a string"}


def _describe(hint: Any) -> str:
    if hint in _TYPE_NAMES:
        return _TYPE_NAMES[hint]
    if hint is Path:
        return "a path (string)"
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is Literal:
        return f"one of {list(typing.get_args(hint))}"
    return " or ".join(_describe(h) for h in typing.get_args(hint))


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    """(ok, the value as `hint`): ints are numbers, strings are paths; bools are no ints."""
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        for member in typing.get_args(hint):
            ok, converted = _convert(member, value)
            if ok:
                return True, converted
        return False, None
    if origin is Literal:
        return value in typing.get_args(hint) and isinstance(value, str), value
    if hint is type(None):
        return value is None, None
    if hint is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, None
    if hint is int:
        return isinstance(value, int), value
    if hint is float:
        return isinstance(value, int | float), float(value) if isinstance(value, int) else value
    if hint is str:
        return isinstance(value, str), value
    if hint is Path:
        return isinstance(value, str | Path), Path(value) if isinstance(value, str) else value
    raise TypeError(f"unsupported option type {hint!r}")


def _checked(key: str, hint: Any, value: Any, prefix: str) -> Any:
    """`value` converted to the field's type, or ConfigError naming `key`."""
    ok, converted = _convert(hint, value)
    if not ok:
        raise ConfigError(key, f"{prefix}{key}: expected {_describe(hint)}, got {value!r}")
    choices = option_field(key).metadata.get("choices")
    if choices is not None and converted is not None and converted not in choices:
        raise ConfigError(key, f"{prefix}{key}: expected one of {list(choices)}, got {value!r}")
    return converted


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _toml_value(value: Any) -> str:
    """A TOML literal of a bool, int, float or str. Hand-written: the stdlib reads TOML but
    cannot write it, and flat tables of scalars need no dependency."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # inf, nan, 1e-08 and 0.001 are TOML floats as Python prints them
    if isinstance(value, str):
        return '"' + "".join(_escape(c) for c in value) + '"'
    raise TypeError(f"no TOML literal for {value!r}")


def _escape(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or ord(char) == 0x7F:  # control characters: TOML wants them escaped
        return f"\\u{ord(char):04x}"
    return char
