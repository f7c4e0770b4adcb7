"""Developer sessions for the lm-systems monorepo.

CPU machine (CI): nox -s lint tests             one venv per package (uv), the CPU torch wheel
GPU machine:      nox -s gpu_tests nccl_tests   the interpreter's own torch/triton, no installs
Either machine:   nox -s faults                 fault injection, each case 20 times
Benchmarks:       nox -s bench -- --size xl     the current interpreter (GPU box or CPU)

Venvs are built by uv when it is installed beside nox (`pip install nox uv`), else by
virtualenv and pip. uv reads no pip configuration, so the machine's pip sources (find-links,
index URLs, constraints: e.g. a local CPU torch wheel) are handed to it as UV_* variables and
it resolves as pip would. Its cache hard-links one copy of torch and triton into every venv.

The GPU sessions and `faults` never build a venv or touch an index: they run with the
interpreter that runs nox (`python=False`, `sys.executable`) and put every package's `src/` on
PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "uv|virtualenv"

# package dir -> (import name, other workspace packages its tests need)
PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lm-core": ("lm_core", ("flashattn-triton", "ddp-kit", "zero-shard")),
    "flashattn-triton": ("flashattn_triton", ()),
    "ddp-kit": ("ddp_kit", ()),
    "zero-shard": ("zero_shard", ("ddp-kit",)),
    "perf-tools": ("perf_tools", ("lm-core", "flashattn-triton", "ddp-kit", "zero-shard")),
}
# The CPU wheel itself: a bare `torch` (or `torch==2.13.0`) may resolve to PyPI's multi-GB
# CUDA build; only CPU builds carry `+cpu` (pip's sources must hold one: a local wheel
# directory, or the PyTorch CPU index https://download.pytorch.org/whl/cpu).
CPU_TORCH = "torch==2.13.0+cpu"
# Optional extras a package's CPU tests exercise (installed with it in its `tests` session):
# flashattn-triton's kernels run in Triton's interpreter (numpy); lm-core's text pipeline and
# TensorBoard logging.
EXTRAS = {"flashattn-triton": "[interpret,hf]", "lm-core": "[text,tensorboard]"}
# pip configuration key -> the uv variable that means the same, and how uv separates values
PIP_TO_UV = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
}
# Suites that spawn process groups stay serial; the rest use pytest-xdist.
XDIST_SAFE = {"lm-core", "flashattn-triton", "perf-tools"}


@cache
def _pip_sources_for_uv() -> dict[str, str]:
    """The machine's pip sources (`pip config list`, environment variables included) as uv
    environment variables; values already set for uv win. Empty when pip has none."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return _uv_env(out, os.environ)


def _uv_env(pip_config: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The UV_* variables that mean what `pip config list` printed (`pip_config`), except
    those `environ` sets already."""
    pip: dict[str, str] = {}
    for line in pip_config.splitlines():  # e.g. global.find-links='/some/dir' (env first)
        key, sep, value = line.partition("=")
        if sep:
            pip.setdefault(key.rsplit(".", 1)[-1], value.strip().strip("'\""))
    env = {}
    for name, (uv_name, joiner) in PIP_TO_UV.items():
        if name in pip and uv_name not in environ:
            env[uv_name] = joiner.join(pip[name].split())
    if env and "UV_INDEX_STRATEGY" not in environ:
        # pip takes the best version over all its sources; uv's default stops at the first
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return env


def _install(session: nox.Session, *args: str) -> None:
    """session.install, with the machine's pip sources when uv installs."""
    env: dict[str, str] = {}
    if session.venv_backend == "uv":
        env.update(_pip_sources_for_uv())
        # pip writes .pyc files at install time, uv only when asked: without them every fresh
        # interpreter (each spawned rank) recompiles torch where PYTHONDONTWRITEBYTECODE is set
        env.setdefault("UV_COMPILE_BYTECODE", os.environ.get("UV_COMPILE_BYTECODE", "1"))
    session.install(*args, env=env)


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
    _install(session, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's CPU tests, installed (not editable) with only the packages it declares."""
    _, needs = PACKAGES[package]
    _install(
        session,
        CPU_TORCH,
        "pytest",
        "pytest-xdist",
        "pytest-timeout",
        *(f"./packages/{p}{EXTRAS.get(p, '')}" for p in (*needs, package)),
    )
    args = ["-m", "not gpu and not nccl", "--timeout=900"]
    if package in XDIST_SAFE:
        args += ["-n", "2"]
    junit = Path(session.create_tmp()) / f"junit-{package}.xml"
    ran = session.run(
        "pytest",
        f"packages/{package}/tests",
        *args,
        f"--junitxml={junit}",
        *session.posargs,
        # (the C++ launch path's tests fail, not skip, without a C++ compiler or ninja)
        env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
             "FLASHATTN_TRITON_TEST_REQUIRE_CPP": "1"},
    )  # fmt: skip
    if ran is not None:  # None: `nox --install-only` builds the venvs and runs nothing
        _assert_ran_tests(junit, package)


def _current_interpreter_pytest(session: nox.Session, marker: str, env: dict[str, str]) -> None:
    session.run(
        sys.executable,
        "-c",
        "import torch, sys; n = torch.cuda.device_count(); "
        "print('torch', torch.__version__, 'GPUs', n); sys.exit(0 if n else 'no CUDA GPU visible')",
        external=True,
    )
    junit = ROOT / ".nox" / f"junit-{marker}.xml"
    junit.parent.mkdir(exist_ok=True)
    session.run(
        sys.executable,
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
        sys.executable,
        "-m",
        "perf_tools.bench",
        *session.posargs,
        env={"PYTHONPATH": _src_path()},
        external=True,
    )
