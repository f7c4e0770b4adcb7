"""Every wrapper against single-process training on the whole batch, over 2 processes.

One spawned group per backend runs all scenarios (see ddpkit_scenarios.py) and each test
checks its own scenario's result on both ranks: gloo on CPU here, NCCL on 2 GPUs under
`nox -s nccl_tests` (same code, device chosen per backend).
"""

from __future__ import annotations

import pytest
from ddpkit_scenarios import WRAPPERS, correctness_cases, run_correctness, run_reduce_dtype

from ddp_kit.launch import spawn

NAMES = list(correctness_cases())
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.nccl),
]


@pytest.fixture(scope="module", params=BACKENDS)
def results(request: pytest.FixtureRequest) -> list[dict[str, list[str]]]:
    backend = request.param
    return spawn(run_correctness, 2, backend=backend, args=(backend, NAMES), timeout_s=600)


@pytest.mark.parametrize("name", NAMES)
def test_wrapper_matches_single_process(results: list[dict[str, list[str]]], name: str) -> None:
    """Gradients, losses and weights equal the whole-batch reference on both ranks, and the
    ranks' weights are bit-identical (scenario details in `correctness_cases`)."""
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == [], f"rank {rank}: " + "; ".join(per_rank[name])


@pytest.fixture(scope="module", params=BACKENDS)
def reduce_dtype_results(request: pytest.FixtureRequest) -> list[dict[str, list[str]]]:
    backend = request.param
    return spawn(run_reduce_dtype, 2, backend=backend, args=(backend,), timeout_s=300)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_reduce_dtype_sends_gradients_in_bf16(
    reduce_dtype_results: list[dict[str, list[str]]], kind: str
) -> None:
    """`reduce_dtype=torch.bfloat16`: the averaged gradients are the bf16 average of the
    ranks' gradients, cast back (details in `run_reduce_dtype`), and the ranks stay equal."""
    for rank, per_rank in enumerate(reduce_dtype_results):
        assert per_rank[kind] == [], f"rank {rank}: " + "; ".join(per_rank[kind])
