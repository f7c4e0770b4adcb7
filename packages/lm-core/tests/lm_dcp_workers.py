"""Functions run inside `ddp_kit.launch.spawn` workers for the sharded-checkpoint tests
(module level: picklable)."""

from __future__ import annotations

from typing import Any

import torch


def train_and_report(
    rank: int, world: int, runs: list[list[str]], failing: tuple = ()
) -> list[dict[str, Any]]:
    """Run `python -m lm_core.train` argv lists one after another in this rank's process
    group. Per run: the full weights and the full optimizer state (gathered / consolidated
    while the group is up; complete on rank 0), the logged losses and the step reached. Then
    the `failing` argv lists, each expected to raise: per run, the error as text."""
    from lm_core.train import main

    torch.set_num_threads(1)
    out = []
    for argv in runs:
        result = main(argv)
        weights = {k: v.detach().cpu() for k, v in result.full_state_dict().items()}
        optim = result.parallel.full_optimizer_state_dict(result.optimizer)
        out.append(
            {
                "weights": weights,
                "optim": optim,
                "losses": [h["loss"] for h in result.history],
                "step": result.step,
            }
        )
    for argv in failing:
        try:
            main(argv)
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        else:
            out.append({"error": None})
    return out
