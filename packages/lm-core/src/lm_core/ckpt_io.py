"""Checkpoint bytes on disk: atomic writes, stale temporary files, and a content checksum.

`atomic_write` writes a temporary file next to the target, fsyncs it, renames it over the
target (`os.replace`) and fsyncs the directory, so a crash never leaves a half-written target
and an older file at the target survives a failed write. The temporary file is created like a
normal `open()` (mode 0o666 minus the umask) and named `.<target name>.<pid>.<8 hex>.tmp`; a
process killed mid-write (SIGKILL, OOM killer, power loss) leaves one behind, and the next
write to the same target removes those whose process no longer runs on this host. A SIGINT or
SIGTERM whose Python handler would raise (Ctrl-C, a handler that exits) is held back while the
file is written and renamed and handled right after: raised inside torch.save's C++ writer, such
an exception aborted the process or surfaced as an unrelated error with the file half-written.

`payload_digest` is a SHA-256 over a checkpoint's contents (every tensor's dtype, shape and
bytes, every plain value and the nesting), independent of the device tensors are loaded to.
Tensors are hashed in threads (hashlib releases the GIL), so large checkpoints hash at several
GB/s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


def temp_name(target: Path) -> str:
    """Name of a temporary file for `target` written by this process."""
    return f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _temp_pid(name: str, target: Path) -> int | None:
    """The writer's pid if `name` is one of our temporary files for `target`, else None."""
    prefix = f".{target.name}."
    if not (name.startswith(prefix) and name.endswith(".tmp")):
        return None
    pid, sep, tag = name[len(prefix) : -len(".tmp")].partition(".")
    if not (sep and pid.isdigit() and len(tag) == 8):
        return None
    if any(c not in "0123456789abcdef" for c in tag):
        return None
    return int(pid)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only (POSIX)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Delete temporary files of `atomic_write` for `target` whose writer process is gone.

    Only files of our name pattern next to the target whose pid is not a running process of
    this host are removed (POSIX; elsewhere nothing is removed). A writer on another host
    sharing the directory may have a pid that is free here: its rename then fails loudly
    instead of silently losing data."""
    if os.name != "posix" or not target.parent.is_dir():
        return []
    removed = []
    for entry in os.scandir(target.parent):
        pid = _temp_pid(entry.name, target)
        if pid is None or pid == os.getpid() or _process_alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX; a no-op where directories cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM for the block where their handlers are Python callables
    (on the main thread; elsewhere, and for the default C-level actions, nothing changes);
    the first one that came is handed to its handler when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            saved[sig] = handler
            signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if pending:
            signum, frame = pending[0]
            saved[signum](signum, frame)


def atomic_write(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(f)` on a fresh temporary file and rename it over `target` when complete
    (SIGINT / SIGTERM handled after that, `signals_deferred`)."""
    with signals_deferred():
        _atomic_write(target, write)


def _atomic_write(target: Path, write: Callable[[BinaryIO], None]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)  # first: an orphan may hold the disk space this write needs
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = target.parent / temp_name(target)
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as for open()
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _items(value: Any) -> Iterator[bytes | torch.Tensor]:
    """A canonical stream of structure bytes and tensors for `value` (dict keys sorted)."""
    if isinstance(value, torch.Tensor):
        yield f"T{value.dtype}{tuple(value.shape)}|".encode()
        yield value
    elif isinstance(value, Mapping):
        keys = sorted(value, key=lambda k: (type(k).__name__, repr(k)))
        yield f"D{len(keys)}|".encode()
        for key in keys:
            yield from _items(key)
            yield from _items(value[key])
    elif isinstance(value, list | tuple):
        yield f"L{len(value)}|".encode()
        for item in value:
            yield from _items(item)
    elif isinstance(value, set | frozenset):
        yield f"E{len(value)}|".encode()
        for item in sorted(value, key=repr):
            yield from _items(item)
    elif value is None or isinstance(value, bool):
        yield f"{value}|".encode()
    elif isinstance(value, int):
        yield f"I{value}|".encode()
    elif isinstance(value, float):
        yield f"F{value.hex()}|".encode()
    elif isinstance(value, str | bytes):
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        yield f"{type(value).__name__}{len(data)}|".encode() + data
    else:  # dtypes, devices, complex numbers: their repr is stable
        yield f"O{type(value).__qualname__}:{value!r}|".encode()


def _tensor_digest(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    flat = t.resolve_conj().resolve_neg().reshape(-1).cpu().contiguous()  # (numel,)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    return hashlib.sha256(memoryview(raw.numpy())).digest()


def payload_digest(payload: Mapping[str, Any], skip: str | None = None) -> str:
    """SHA-256 (hex) of `payload`'s contents, leaving out its key `skip`."""
    items = list(_items({k: v for k, v in payload.items() if k != skip}))
    tensors = [item for item in items if isinstance(item, torch.Tensor)]
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = iter(list(pool.map(_tensor_digest, tensors)))
    h = hashlib.sha256()
    for item in items:
        h.update(next(digests) if isinstance(item, torch.Tensor) else item)
    return h.hexdigest()
