"""Misuse raises a clear error naming the problem, on every rank, and never hangs."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
from ddpkit_scenarios import ToyNet, run_errors

import ddp_kit
from ddp_kit.launch import spawn

WRAPPER_CLASSES = [
    ddp_kit.NaiveDDP,
    ddp_kit.FlatDDP,
    ddp_kit.DDPIndividualParameters,
    ddp_kit.DDPBucketed,
]
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.nccl),
]


@pytest.mark.parametrize("cls", WRAPPER_CLASSES, ids=lambda c: c.__name__)
def test_no_process_group_says_how_to_start_one(cls: type) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        cls(ToyNet())


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, -math.inf])
def test_bucket_size_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ddp_kit.DDPBucketed(ToyNet(), bucket_size_mb=bad)


@pytest.mark.parametrize("bad", ["25", None, True])
def test_bucket_size_must_be_a_number(bad: object) -> None:
    with pytest.raises(TypeError, match="bucket_size_mb"):
        ddp_kit.DDPBucketed(ToyNet(), bucket_size_mb=bad)


@pytest.mark.parametrize("cls", WRAPPER_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [torch.int32, torch.bool, "bf16", 16])
def test_reduce_dtype_must_be_a_floating_dtype(cls: type, bad: object) -> None:
    with pytest.raises(TypeError, match=f"{cls.__name__}: reduce_dtype: expected None"):
        cls(ToyNet(), reduce_dtype=bad)


@pytest.mark.parametrize("cls", WRAPPER_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (datetime.timedelta(0), ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
def test_timeout_must_be_a_positive_duration(cls: type, bad: object, exc: type) -> None:
    with pytest.raises(exc, match=f"{cls.__name__}: timeout: expected"):
        cls(ToyNet(), timeout=bad)


def test_module_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="module"):
        ddp_kit.NaiveDDP(lambda x: x)


@pytest.fixture(scope="module", params=BACKENDS)
def error_results(request: pytest.FixtureRequest) -> list[dict[str, str]]:
    backend = request.param
    return spawn(
        run_errors, 2, backend=backend, args=(backend,), timeout_s=180, collective_timeout_s=60
    )


ERROR_CASES = [
    *(
        f"{k}-{case}"
        for k in ("naive", "flat", "individual", "bucketed")
        for case in (
            "shape-mismatch",
            "finish-before-backward",
            "finish-twice",
            "finish-after-no-sync-only",
            "second-backward",
            "no-sync-before-finish",
            "wrapped-twice",
        )
    ),
    "param-count-mismatch",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_misuse_raises_clear_error(error_results: list[dict[str, str]], case: str) -> None:
    for rank, per_rank in enumerate(error_results):
        assert per_rank[case] == "", f"rank {rank}: {per_rank[case]}"


def test_nccl_group_rejects_a_cpu_module(error_results: list[dict[str, str]]) -> None:
    if "nccl-cpu-module" not in error_results[0]:
        pytest.skip("only an NCCL group refuses CPU tensors")
    for rank, per_rank in enumerate(error_results):
        assert per_rank["nccl-cpu-module"] == "", f"rank {rank}: {per_rank['nccl-cpu-module']}"
