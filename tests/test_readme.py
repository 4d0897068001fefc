"""Every fenced code block of README.md runs as pasted, in a fresh temporary directory.

- ```python blocks run with ``exec`` in a fresh namespace (cwd = a temporary directory);
- in ```bash blocks (and unlabelled ones) every line that starts with ``treecompile `` runs through
  ``treecompile.cli.main(argv)`` (exit status 0); other lines (``pip install``, ``python -m pytest``) are not run.

Indented (4-space) code blocks are not allowed: they would not be extracted (one test finds them).

A block that cannot run here says so in the README, on the line just above its fence:
``<!-- readme-test: skip (needs torchrun) -->``, so that every skip is visible to readers of the source.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import shared_capture

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((.+)\)\s*-->\s*$")


def readme_blocks(text: str) -> list[dict]:
    """Fenced blocks: language, first line number (1-based), source, skip reason (or None)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"README.md:{i + 1}: unterminated code fence")
        above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.match(above.strip())
        blocks.append({"lang": m.group(1) or "", "line": i + 1, "source": "\n".join(lines[i + 1:j]) + "\n",
                       "skip": skip.group(1) if skip else None})
        i = j + 1
    return blocks


def indented_blocks(text: str) -> list[int]:
    """First lines (1-based) of Markdown indented code blocks outside fences (a blank line, then >= 4 spaces)."""
    found, in_fence, prev = [], False, ""
    for k, ln in enumerate(text.splitlines()):
        if FENCE.match(ln) or (in_fence and ln.rstrip() == "```"):
            in_fence = not in_fence
        elif not in_fence and ln.startswith("    ") and ln.strip() and not prev.strip():
            found.append(k + 1)
        prev = ln
    return found


def _runnable(block) -> bool:
    if block["lang"] == "python":
        return True
    return block["lang"] in ("", "bash", "sh", "shell") and any(
        ln.strip().startswith("treecompile ") for ln in block["source"].splitlines())


BLOCKS = [b for b in readme_blocks((ROOT / "README.md").read_text()) if _runnable(b)]


def test_the_extractor_sees_fences_and_skip_marks():
    text = "a\n<!-- readme-test: skip (needs torchrun) -->\n```python\nx = 1\n```\n\n```bash\ntreecompile demo\n```\n"
    b = readme_blocks(text)
    assert [(x["lang"], x["line"], x["skip"]) for x in b] == [("python", 3, "needs torchrun"), ("bash", 7, None)]
    assert b[0]["source"] == "x = 1\n"
    assert any(x["lang"] == "python" for x in BLOCKS)  # the README's "Use" example is one of them


def test_every_code_block_is_fenced():
    assert indented_blocks("a\n\n    x = 1\n\n```\n\n    y\n```\n") == [3]  # not the fenced one
    lines = indented_blocks((ROOT / "README.md").read_text())
    assert not lines, f"README.md:{lines}: indented code blocks are not run by this test; fence them"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b['line']}" for b in BLOCKS])
def test_readme_block_runs_as_pasted(block, tmp_path, monkeypatch, capsys):
    if block["skip"]:
        pytest.skip(f"README.md:{block['line']}: {block['skip']}")
    monkeypatch.chdir(tmp_path)
    # the blocks build the same tiny reference model again and again: one torch.export per process and
    # architecture (helpers.shared_capture), every block's passes, runs and files as usual
    with shared_capture():
        if block["lang"] == "python":
            code = compile(block["source"], f"README.md:{block['line']}", "exec")
            exec(code, {"__name__": "__readme__"})  # noqa: S102 - the README's own example
            return
        from treecompile import cli

        for k, ln in enumerate(block["source"].splitlines()):
            if not ln.strip().startswith("treecompile "):
                continue
            argv = shlex.split(ln.split(" #", 1)[0])
            # in this process (the console script is `treecompile.cli:main`; test_cli runs the entry point itself)
            assert cli.main(argv[1:]) == 0, f"README.md:{block['line'] + 1 + k}: {ln.strip()}\n{capsys.readouterr().err}"
