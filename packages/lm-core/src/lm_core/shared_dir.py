"""Before training: is `--out-dir` one directory for every rank? A sharded checkpoint needs it.

Every rank writes its own shards of a `--checkpoint-format dcp` checkpoint into one directory
(`lm_core.dcp_checkpoint`). On hosts without a shared filesystem each host has its own copy
of the path, and the first save would fail (a shard file missing on some rank) after the
training it was to keep. So global rank 0 creates a marker file, named at random, in the
out-dir (in its nearest existing ancestor while the out-dir does not exist: creating the
out-dir here would change what the run-directory checks see), hands the name to the other
ranks with the options' verdicts (`agree_to_start`, the run's first collective), every rank
looks for it in the out-dir as its host sees it, and one gather of the answers makes every
rank refuse together, with one message. Rank 0 deletes the marker in any case.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from pathlib import Path

import torch.distributed as dist

from lm_core.distributed import DistEnv, agree_to_start

MARKER_PREFIX = ".lm_core_shared_dir_check."  # + 16 hex digits; deleted by the check
_LOOK_S = (0.0, 0.1, 0.3, 1.0)  # waits before each look: a remote file's name may lag a little


def probe_dir(out_dir: str | os.PathLike[str]) -> Path:
    """`out_dir` or its nearest existing ancestor, absolute as this process sees it."""
    path = Path(os.path.abspath(out_dir))
    while not path.is_dir() and path.parent != path:
        path = path.parent
    return path


def start_together(env: DistEnv, out_dir: Path | None, checkpoint_format: str | None) -> None:
    """`agree_to_start(env)`; with `checkpoint_format` "dcp", several ranks and an `out_dir`,
    also the check that `out_dir` is one directory shared by every rank (module docstring;
    one more small gather). Collective: call it on every rank. Raises a RuntimeError, on every
    rank, naming the out-dir and the remedies when some rank does not see rank 0's marker."""
    if checkpoint_format != "dcp" or env.world_size == 1 or out_dir is None:
        agree_to_start(env)
        return
    where = probe_dir(out_dir)
    name = refusal = None
    if env.is_main:
        name = MARKER_PREFIX + secrets.token_hex(8)
        try:
            fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
        except OSError as exc:
            name = None
            refusal = (
                f"--out-dir {out_dir}: cannot create a file in {where} (to check that every "
                f"rank sees it, as --checkpoint-format dcp needs): {exc}"
            )
    try:
        shared = agree_to_start(env, refusal, share=name)  # the others learn the name
        if refusal is not None:  # the others raised in agree_to_start, quoting it
            raise RuntimeError(refusal)
        seen = _visible(where / shared)
        answers: list[tuple[bool, str, str] | None] = [None] * env.world_size
        dist.all_gather_object(answers, (seen, socket.gethostname(), str(where)))
    finally:
        if name is not None:
            with contextlib.suppress(OSError):  # never hide the error that got us here
                (where / name).unlink()
    blind = [(rank, a) for rank, a in enumerate(answers) if a is not None and not a[0]]
    if blind:
        raise RuntimeError(_message(out_dir, answers, blind))


def _visible(path: Path) -> bool:
    for wait in _LOOK_S:  # waits only where the marker is missing (a refusal is coming)
        time.sleep(wait)
        if path.is_file():
            return True
    return False


def _message(out_dir: Path, answers: list, blind: list) -> str:
    rank, (_, host, where) = blind[0]
    _, host0, where0 = answers[0]
    more = len(blind) - 1
    others = {0: "", 1: ", nor does 1 other rank"}.get(more, f", nor do {more} other ranks")
    return (
        f"--checkpoint-format dcp: --out-dir {out_dir} is not one directory shared by all "
        f"{len(answers)} ranks: rank {rank} (host {host}) does not see the file that rank 0 "
        f"(host {host0}) created in {where0} (it looked in {where}){others}. Every rank "
        "writes its shards of a sharded checkpoint into that one directory, so the first save "
        "would fail: put --out-dir on a filesystem that every host mounts (at the same path "
        "on each), or pass --checkpoint-format full (rank 0 gathers the states and writes one "
        "file)"
    )
