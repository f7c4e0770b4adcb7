"""The repository's noxfile (read as source: nox is not installed in the test venvs)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

NOXFILE = Path(__file__).resolve().parents[3] / "noxfile.py"
TREE = ast.parse(NOXFILE.read_text())


def _sessions_without_venv() -> list[ast.FunctionDef]:
    out = []
    for node in TREE.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call) and any(
                k.arg == "python" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in dec.keywords
            ):
                out.append(node)
    return out


def test_no_session_runs_the_first_python_on_path():
    """Sessions without a venv must call sys.executable (the interpreter running nox, which has
    torch): a bare "python" is whatever PATH finds first."""
    assert {f.name for f in _sessions_without_venv()} >= {"gpu_tests", "nccl_tests", "bench"}
    for node in ast.walk(TREE):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "run"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            assert node.args[0].value not in ("python", "python3"), ast.unparse(node)[:120]


def _uv_env():
    """noxfile._uv_env and PIP_TO_UV, compiled alone (no nox import)."""
    keep = [
        n
        for n in TREE.body
        if (isinstance(n, ast.FunctionDef) and n.name == "_uv_env")
        or (
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "PIP_TO_UV" for t in n.targets)
        )
    ]
    assert len(keep) == 2
    namespace: dict = {"Mapping": Mapping}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(NOXFILE), "exec"), namespace)
    return namespace["_uv_env"]


def test_pip_sources_are_handed_to_uv():
    uv_env = _uv_env()
    config = (
        ":env:.find-links='/env/wheels'\n"
        "global.find-links='/a/wheels /b/wheels'\n"
        "global.extra-index-url='file:///x/simple file:///y/simple'\n"
        "global.constraint='/etc/pip/constraints.txt'\n"
        "global.cert='/etc/ssl/cert.pem'\n"
    )
    assert uv_env(config, {}) == {
        "UV_FIND_LINKS": "/env/wheels",  # pip's environment beats its config file
        "UV_EXTRA_INDEX_URL": "file:///x/simple file:///y/simple",
        "UV_CONSTRAINT": "/etc/pip/constraints.txt",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
    }
    several = uv_env("global.find-links='/a /b'\n", {})
    assert several["UV_FIND_LINKS"] == "/a,/b"  # uv separates find-links with commas
    mine = uv_env(config, {"UV_FIND_LINKS": "/mine", "UV_INDEX_STRATEGY": "first-index"})
    assert "UV_FIND_LINKS" not in mine
    assert "UV_INDEX_STRATEGY" not in mine
    assert uv_env("", {}) == {}
