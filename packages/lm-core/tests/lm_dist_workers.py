"""Functions run inside `ddp_kit.launch.spawn` worker processes (module level: picklable)."""

from __future__ import annotations

from typing import Any

import torch


def train_runs(rank: int, world: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    """Run `python -m lm_core.train` argv lists one after another in this rank's process group.

    Returns, per run, the final weights (CPU; the full state under --fsdp, gathered while the
    group is up, complete on rank 0) and logged losses; the trainer reuses the group that
    spawn initialized and leaves it alone.
    """
    from lm_core.train import main

    torch.set_num_threads(1)
    out = []
    for argv in runs:
        result = main(argv)
        out.append(
            {
                "weights": {k: v.detach().cpu() for k, v in result.full_state_dict().items()},
                "losses": [h["loss"] for h in result.history],
                "step": result.step,
                # collective counts of zero_shard.FSDP (--fsdp ours), since construction
                "stats": dict(getattr(getattr(result.parallel, "fsdp", None), "stats", {})),
            }
        )
    return out


def shared_dir_checks(rank: int, world: int, root: str) -> list[str | None]:
    """`lm_core.shared_dir.start_together` in this rank's process group on out-dirs under
    `root`: an existing one, a missing one, and one path per rank (`host<rank>/run`, two
    hosts without a shared filesystem) with the dcp and the full format. Per case: None, or
    the error as text."""
    from pathlib import Path

    from lm_core.distributed import setup_distributed
    from lm_core.shared_dir import start_together

    env = setup_distributed("torch")  # the group spawn initialized
    base = Path(root)
    cases = [
        (base / "existing", "dcp"),
        (base / "new" / "run", "dcp"),
        (base / f"host{rank}" / "run", "dcp"),
        (base / f"host{rank}" / "run", "full"),
    ]
    out: list[str | None] = []
    for out_dir, checkpoint_format in cases:
        try:
            start_together(env, out_dir, checkpoint_format)
        except RuntimeError as exc:
            out.append(str(exc))
        else:
            out.append(None)
    return out


def dtensor_bf16_adamw(rank: int, world: int, fused: bool) -> list[dict[str, torch.Tensor]]:
    """lm_core's AdamW with bf16 moments (rounded to nearest) over DTensor parameters sharded
    (Shard(0)) and replicated on a 1-D mesh of all ranks, and over the same parameters as
    plain tensors; returns, per run, the full weights and moments after 3 steps (fused=True:
    the Triton kernel, in its interpreter on CPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lm_core import AdamW

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(4 * world, 6, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in full] for _ in range(3)]
    out = []
    for distributed in (True, False):
        placements = ([Shard(0)], [Replicate()])
        params = [
            # (a replicated DTensor may share the given tensor's storage: a copy each time)
            torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl) if distributed else t.clone())
            for t, pl in zip(full, placements)
        ]
        opt = AdamW(params, lr=1e-2, fused=fused, state_dtype=torch.bfloat16,
                    state_rounding="nearest")  # fmt: skip
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = distribute_tensor(gr.clone(), mesh, p.placements) if distributed else gr
            opt.step()
        whole = {}
        for i, p in enumerate(params):
            state = opt.state[p]
            for name, t in (("p", p), ("m", state["exp_avg"]), ("v", state["exp_avg_sq"])):
                t = t.detach()
                whole[f"{name}{i}"] = t.full_tensor() if distributed else t
        out.append(whole)
    return out


def train_with_a_fault(
    rank: int, world: int, runs: list[list[str]], fault_rank: int, where: str
) -> list[tuple[str, str] | None]:
    """`python -m lm_core.train` argv lists in this rank's process group, with the full
    checkpoint's write ("save") or read ("resume") failing on rank `fault_rank` only, as a
    full disk or a damaged copy on one host would. Per run: None, or the error it raised
    (type name, message)."""
    from lm_core import train_state
    from lm_core.train import main

    torch.set_num_threads(1)
    out: list[tuple[str, str] | None] = []
    for i, argv in enumerate(runs):
        if rank == fault_rank and i == len(runs) - 1:  # the last run meets the fault

            def fail(*args: Any, **kwargs: Any) -> None:
                if where == "save":
                    raise OSError(28, "No space left on device")
                raise ValueError("checkpoint: damaged copy on this host")

            setattr(train_state, "save_checkpoint" if where == "save" else "read_checkpoint", fail)
        try:
            main(argv)
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(None)
    return out
