"""Developer sessions for the lm-systems monorepo.

CPU machine (CI): nox -s lint tests             one venv per package, CPU torch pinned
GPU machine:      nox -s gpu_tests nccl_tests   the interpreter's own torch/triton, no installs
Either machine:   nox -s faults                 fault injection, each case 20 times
Benchmarks:       nox -s bench -- --size xl     the current interpreter (GPU box or CPU)

The GPU sessions and `faults` never build a venv or touch an index: they run with the
interpreter that runs nox (`python=False`) and put every package's `src/` on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# package dir -> (import name, other workspace packages its tests need)
PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lm-core": ("lm_core", ("flashattn-triton", "ddp-kit", "zero-shard")),
    "flashattn-triton": ("flashattn_triton", ()),
    "ddp-kit": ("ddp_kit", ()),
    "zero-shard": ("zero_shard", ("ddp-kit",)),
    "perf-tools": ("perf_tools", ("lm-core", "flashattn-triton", "ddp-kit", "zero-shard")),
}
# The CPU build of torch that lies on local disk; a bare `torch` may pull a multi-GB CUDA build.
CPU_TORCH = "torch==2.13.0"
# Suites that spawn process groups stay serial; the rest use pytest-xdist.
XDIST_SAFE = {"lm-core", "flashattn-triton", "perf-tools"}


def _src_path() -> str:
    return os.pathsep.join(str(ROOT / "packages" / p / "src") for p in PACKAGES)


def _assert_ran_tests(junit: Path, label: str) -> None:
    """Fail when pytest collected nothing or skipped everything: zero tests is not a pass."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    if total - skipped <= 0:
        raise nox.command.CommandFailed(
            f"{label}: no test ran ({total} collected, {skipped} skipped)"
        )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's CPU tests, installed (not editable) with only the packages it declares."""
    _, needs = PACKAGES[package]
    session.install(CPU_TORCH)
    session.install("pytest", "pytest-xdist", "pytest-timeout")
    session.install(*(f"./packages/{p}" for p in (*needs, package)))
    args = ["-m", "not gpu and not nccl", "--timeout=900"]
    if package in XDIST_SAFE:
        args += ["-n", "2"]
    junit = Path(session.create_tmp()) / f"junit-{package}.xml"
    session.run(
        "pytest",
        f"packages/{package}/tests",
        *args,
        f"--junitxml={junit}",
        *session.posargs,
        env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    _assert_ran_tests(junit, package)


def _current_interpreter_pytest(session: nox.Session, marker: str, env: dict[str, str]) -> None:
    session.run(
        "python",
        "-c",
        "import torch, sys; n = torch.cuda.device_count(); "
        "print('torch', torch.__version__, 'GPUs', n); sys.exit(0 if n else 'no CUDA GPU visible')",
        external=True,
    )
    junit = ROOT / ".nox" / f"junit-{marker}.xml"
    junit.parent.mkdir(exist_ok=True)
    session.run(
        "python",
        "-m",
        "pytest",
        *(f"packages/{p}/tests" for p in PACKAGES),
        "-m",
        marker,
        f"--junitxml={junit}",
        *session.posargs,
        env={"PYTHONPATH": _src_path(), **env},
        external=True,
    )
    _assert_ran_tests(junit, marker)


@nox.session(python=False)
def gpu_tests(session: nox.Session) -> None:
    """Kernels at real sizes and dtypes against references, on the machine's own torch/triton."""
    _current_interpreter_pytest(session, "gpu", {})


@nox.session(python=False)
def nccl_tests(session: nox.Session) -> None:
    """Data-parallel wrappers and sharding over NCCL on 2 GPUs (NVLink multicast kept off)."""
    _current_interpreter_pytest(session, "nccl", {"NCCL_NVLS_ENABLE": "0"})


@nox.session(python=False)
def faults(session: nox.Session) -> None:
    """Every test marked `faults`, each case repeated FAULT_RUNS (20) times in a row, on
    the interpreter that runs nox (CPU or GPU machine; the cases use gloo on the CPU)."""
    junit = ROOT / ".nox" / "junit-faults.xml"
    junit.parent.mkdir(exist_ok=True)
    session.run(
        sys.executable,
        "-m",
        "pytest",
        *(f"packages/{p}/tests" for p in PACKAGES),
        "-m",
        "faults",
        f"--junitxml={junit}",
        *session.posargs,
        env={
            "PYTHONPATH": _src_path(),
            "FAULT_RUNS": os.environ.get("FAULT_RUNS", "20"),
            "TRITON_INTERPRET": "1",
        },
        external=True,
    )
    _assert_ran_tests(junit, "faults")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """`python -m perf_tools.bench` with the current interpreter; arguments after `--` pass on."""
    session.run(
        "python",
        "-m",
        "perf_tools.bench",
        *session.posargs,
        env={"PYTHONPATH": _src_path()},
        external=True,
    )
