"""Checkpoint directories on disk: written whole beside the target, then swapped in; the
state an interrupted save leaves; file checksums.

A sharded checkpoint `D` is a directory (torch.distributed.checkpoint's files from every rank
plus our manifest). A save writes a new one under a temporary sibling `.D.<pid>.<8 hex>.tmp`;
the manifest is written last, so a directory holding it is complete (its checksums say
whether it is intact). Then the swap: `D` is renamed to `.D.<pid>.<8 hex>.old`, the new
directory to `D`, the old one deleted. The previous checkpoint is never touched before the new
one is complete: a process killed while writing leaves `D` as it was (and an incomplete
temporary), one killed between the two renames leaves no `D` but the complete new directory
and the old one beside it. `resolve_dir` (what loads read) then takes the complete new one,
and the next save first renames it into place (`recover`) and deletes the leftovers of
writers that no longer run (POSIX pid check, as `lm_core.ckpt_io` does for files).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from pathlib import Path

from lm_core.ckpt_io import _fsync_dir, _process_alive

META_NAME = "lm_core_meta.pt"  # a sharded checkpoint's manifest, written last
_KINDS = ("tmp", "old")
_READ_BYTES = 1 << 22


def sibling_name(target: Path, kind: str) -> str:
    """A fresh name for a temporary (`kind` "tmp") or an outgoing ("old") copy of `target`."""
    return f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"


def _parse(name: str, target: Path) -> tuple[int, str] | None:
    """(writer pid, kind) if `name` is one of our siblings of `target`, else None."""
    prefix = f".{target.name}."
    if not name.startswith(prefix):
        return None
    pid, _, rest = name[len(prefix) :].partition(".")
    tag, _, kind = rest.partition(".")
    if not (pid.isdigit() and kind in _KINDS and len(tag) == 8):
        return None
    if any(c not in "0123456789abcdef" for c in tag):
        return None
    return int(pid), kind


def siblings(target: Path) -> list[tuple[Path, int, str]]:
    """Our temporary and outgoing directories next to `target`: (path, pid, kind)."""
    if not target.parent.is_dir():
        return []
    found = []
    for entry in os.scandir(target.parent):
        parsed = _parse(entry.name, target)
        if parsed is not None and entry.is_dir(follow_symlinks=False):
            found.append((Path(entry.path), *parsed))
    return found


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a sharded checkpoint directory (or an interrupted save of one
    left a complete checkpoint beside it)."""
    return resolve_dir(Path(path), META_NAME) is not None


def resolve_dir(target: Path, manifest: str) -> Path | None:
    """The directory a load of `target` reads: `target` itself, or where an interrupted swap
    left the latest complete checkpoint (a complete new one first, else the old one); None
    when there is neither."""
    if target.is_dir():
        return target
    complete = [(p, kind) for p, _, kind in siblings(target) if (p / manifest).is_file()]
    for wanted in _KINDS:  # "tmp": the save got as far as the swap
        found = sorted((p for p, kind in complete if kind == wanted), key=_mtime)
        if found:
            return found[-1]
    return None


def _mtime(path: Path) -> float:
    try:
        return (path).stat().st_mtime
    except OSError:
        return 0.0


def recover(target: Path, manifest: str) -> None:
    """Before a save: put back the checkpoint an interrupted swap left beside `target`, then
    delete the directories of dead writers (never a live writer's)."""
    if not target.exists():
        found = resolve_dir(target, manifest)
        if found is not None:
            os.rename(found, target)
            _fsync_dir(target.parent)
    if os.name != "posix":
        return
    for path, pid, _ in siblings(target):
        if pid != os.getpid() and not _process_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def new_temp_dir(target: Path) -> Path:
    """A fresh, empty temporary directory next to `target` (its parent is created)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = target.parent / sibling_name(target, "tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def commit(tmp: Path, target: Path) -> None:
    """Swap the complete directory `tmp` in as `target`; the previous `target` is deleted
    only once the new one is in place."""
    _fsync_dir(tmp)
    old = None
    if target.exists():
        old = target.parent / sibling_name(target, "old")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


THREADS_ENV = "LM_CORE_CHECKPOINT_THREADS"


def io_threads() -> int:
    """Threads per rank for writing and hashing a sharded checkpoint: $LM_CORE_CHECKPOINT_THREADS
    if set, else this host's cores over its ranks (torchrun's LOCAL_WORLD_SIZE), 1 to 8. DCP
    writes one file per thread and hashlib releases the interpreter while it hashes, so both
    scale with cores until the disk is the limit."""
    chosen = os.environ.get(THREADS_ENV)
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"${THREADS_ENV}: expected a positive integer, got {chosen!r}")
        return int(chosen)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(8, (os.cpu_count() or 1) // ranks))


def sha256_files(paths: list[Path], threads: int) -> list[str]:
    """`sha256_file` of each path, `threads` at a time; digests in the order of `paths`."""
    if threads <= 1 or len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


def remove_quietly(path: Path) -> None:
    """Delete a directory tree if it exists (cleanup after a failed save)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
