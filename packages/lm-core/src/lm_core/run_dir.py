"""A training run's files: never start over an existing run unless told, continue its log.

`python -m lm_core.train --out-dir D` writes `D/checkpoint.pt` (or, with `--checkpoint-format
dcp`, the directory `D/checkpoint.dcp`) and a metrics log. Starting a
fresh run over a directory that holds one would replace the checkpoint at the first save and
lose the log, so the trainer asks `existing_run_files` first and refuses unless `--resume` or
`--overwrite` is given. A resumed run continues the log with `continue_metrics`: lines of
steps after the checkpoint's step (the steps it will redo) are dropped, everything else stays.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lm_core.ckpt_io import atomic_write

CHECKPOINT_NAME = "checkpoint.pt"  # in --out-dir
DCP_CHECKPOINT_NAME = "checkpoint.dcp"  # in --out-dir, --checkpoint-format dcp (a directory)


def checkpoint_name(checkpoint_format: str | None) -> str:
    """The checkpoint's name in --out-dir for a `checkpoint.format` ("full" or "dcp")."""
    return DCP_CHECKPOINT_NAME if checkpoint_format == "dcp" else CHECKPOINT_NAME


def existing_run_files(checkpoint: Path | None, metrics: Path | None) -> list[Path]:
    """Those of `checkpoint` and `metrics` that already hold something (non-empty files, or
    a non-empty checkpoint directory)."""
    found = []
    for path in (checkpoint, metrics):
        if path is None:
            continue
        if (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir())):
            found.append(path)
    return found


def same_file(a: Path, b: Path) -> bool:
    """Whether paths `a` and `b` name one existing file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _step_of(line: str) -> int | None:
    """The `step` of a JSON log line; None for a line that is not a JSON object with one."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    step = entry.get("step") if isinstance(entry, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def continue_metrics(path: Path, step: int) -> int:
    """Prepare the JSONL log `path` to continue a run resumed at `step`.

    Keeps every line up to and including `step`; drops lines of later steps (the resumed run
    logs them again) and an unterminated last line (a write cut short by a crash). Lines
    without a step are kept. The file is rewritten atomically only when something is
    dropped. Returns the number of lines dropped.
    """
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    keep = []
    for line in lines:
        if not line.endswith("\n"):
            continue  # torn final line
        s = _step_of(line)
        if s is None or s <= step:
            keep.append(line)
    dropped = len(lines) - len(keep)
    if dropped:
        data = "".join(keep).encode("utf-8")
        atomic_write(path, lambda f: f.write(data))
    return dropped
