"""README code that claims to run on a CPU does: every fenced block right after a
`<!-- cpu ... -->` line, in the repository's READMEs (and the packages' docs/ pages), runs as
written.

bash blocks: one command per line (`# comments` dropped, `python` / `python3` is this
interpreter); python blocks: the whole block. Each runs in a fresh directory, without a GPU.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
READMES = [
    ROOT / "README.md",
    *sorted((ROOT / "packages").glob("*/README.md")),
    *sorted((ROOT / "packages").glob("*/docs/*.md")),
]
MARK = "<!-- cpu"


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block whose fence follows a MARK line."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.strip().startswith(MARK):
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or not lines[j].strip().startswith("```"):
            raise ValueError(f"line {i + 1}: {MARK} ... --> must precede a fenced code block")
        lang = lines[j].strip()[3:].strip()
        body = []
        for k in range(j + 1, len(lines)):
            if lines[k].strip().startswith("```"):
                break
            body.append(lines[k])
        blocks.append((lang, "\n".join(body)))
    return blocks


def snippets() -> list[tuple[str, list[str]]]:
    """(id, argv) of every command of every marked block."""
    out = []
    for readme in READMES:
        name = readme.relative_to(ROOT).as_posix()
        for n, (lang, code) in enumerate(marked_blocks(readme.read_text())):
            if lang == "python":
                out.append((f"{name}#{n}", [sys.executable, "-c", code]))
                continue
            assert lang in ("bash", "sh"), f"{name}: a marked block must be bash or python"
            for line in code.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv:
                    if argv[0] in ("python", "python3"):
                        argv[0] = sys.executable
                    out.append((f"{name}#{n}: {' '.join(argv[1:4])}", argv))
    return out


SNIPPETS = snippets()


def test_the_readmes_mark_their_cpu_commands():
    ids = [i for i, _ in SNIPPETS]
    assert sum(i.startswith("packages/perf-tools/README.md") for i in ids) >= 6
    text = (
        "x\n<!-- cpu -->\n\n```bash\npython -m a  # c\n```\n<!-- cpu -->\n```python\nprint(1)\n```"
    )
    assert marked_blocks(text) == [("bash", "python -m a  # c"), ("python", "print(1)")]
    with pytest.raises(ValueError, match="must precede"):
        marked_blocks("<!-- cpu -->\ntext\n```bash\nls\n```")


@pytest.mark.parametrize("argv", [a for _, a in SNIPPETS], ids=[i for i, _ in SNIPPETS])
def test_snippet_runs_on_cpu(argv, tmp_path):
    # as a user without a GPU runs it: no CUDA device, no test-only Triton interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
