"""The manual's code runs, so the examples a newcomer copies stay true (as tests/test_doctests.py does
for the docstrings).

Every ```` ```python ```` block of README.md and ``docs/**/*.md`` is one test: it runs in a fresh
namespace, in a temporary folder, with ``/content/drive/MyDrive`` (the Colab Drive folder the examples
write to) standing for a folder inside it and ``KEEPALIVE_DIR`` / ``KEEPALIVE_SPOOL`` pointing there
too. A block that cannot run here (it needs Colab, a GPU, ``torchrun``, a cloud, objects of the
reader's own, or a long training) carries ``<!-- not run: <why> -->`` on the line before its fence;
every other block must run without an error. A mark with no reason, or one that marks no python
block, fails, and so does a README over its size budget or without its install cells.

The site itself (links, nav, API pages) is checked by ``mkdocs build --strict`` in scripts/test.sh.
"""
from __future__ import annotations

import dataclasses
import gc
import glob
import importlib.util
import os
import re
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
README_MAX_BYTES = 20_000
DRIVE = "/content/drive/MyDrive"

MARK = re.compile(r"^\s*<!--\s*not run:(?P<why>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


def _load_torchvision_shim() -> None:
    """The registry's torchvision here is a CUDA build next to a CPU torch: transformers and
    lightning import it, which needs the op schemas of the test-only shim first (tests/shims)."""
    spec = importlib.util.spec_from_file_location(
        "_keepalive_tv_shim", os.path.join(ROOT, "tests", "shims", "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


@dataclasses.dataclass
class Block:
    path: str           # relative to the repository root
    line: int           # the line of the opening fence, 1-based
    code: str
    not_run: Optional[str]  # the reason given in the mark, or None: the block runs

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> List[str]:
    return [README] + sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def blocks_of(path: str) -> List[Block]:
    """The python blocks of one Markdown file (fences nested in a longer fence are text)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rel = os.path.relpath(path, ROOT)
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, start = m.group("fence"), len(m.group("indent")), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        if m.group("lang") != "python":
            continue
        mark = MARK.match(lines[start - 1]) if start > 0 else None
        found.append(Block(rel, start + 1, "\n".join(body) + "\n",
                           mark.group("why").strip() if mark else None))
    return found


def stray_marks(path: str) -> List[int]:
    """Lines of ``not run`` marks that are not right before a python fence."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    for n, line in enumerate(lines):
        if MARK.match(line):
            nxt = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
            if nxt is None or nxt.group("lang") != "python":
                out.append(n + 1)
    return out


def _first_of_each(blocks: List[Block]) -> List[Block]:
    """A block that repeats another one word for word (a page's copy of a README quick start) runs once."""
    seen, out = set(), []
    for b in blocks:
        if b.code not in seen:
            seen.add(b.code)
            out.append(b)
    return out


BLOCKS = [b for path in doc_files() for b in blocks_of(path)]
RUN = _first_of_each([b for b in BLOCKS if b.not_run is None])


def test_the_blocks_are_found():
    readme = [b for b in RUN if b.path == "README.md"]
    # the five quick starts of the README run: plain torch, Keras, fastai, HF Trainer, Lightning
    assert len(readme) >= 5, [b.id for b in readme]
    assert len(BLOCKS) > len(readme), "the docs/ pages hold python blocks too"


def test_blocks_not_run_say_why():
    vague = [b.id for b in BLOCKS if b.not_run is not None and len(b.not_run) < 10]
    assert not vague, f"'<!-- not run: ... -->' needs a reason: {vague}"
    stray = [f"{os.path.relpath(p, ROOT)}:{n}" for p in doc_files() for n in stray_marks(p)]
    assert not stray, f"a 'not run' mark must be on the line right before a ```python fence: {stray}"


def test_readme_is_short_and_says_how_to_install():
    size = os.path.getsize(README)
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail into docs/"
    with open(README, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Install\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Install' section"
    install = m.group(1)
    for where in ("Colab", "Kaggle"):
        assert re.search(rf"\*\*{where}\*\*.*?```\n!pip install -q \"keepalive-nb\[\w+\]\"", install, re.S), \
            f"the Install section has no {where} cell"
    assert "git+https://github.com/" in install, "the Install section has no git URL"
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in text, command


def test_every_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = f.read().split("\nnav:", 1)[1]
    pages = {os.path.relpath(p, DOCS) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)}
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    assert pages == listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; " \
                            f"nav entries with no page: {sorted(listed - pages)}"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A temporary working folder that stands for the Drive folder, the default dir and the spool."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "keepalive"))
    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.delenv("KEEPALIVE_VERBOSITY", raising=False)
    return tmp_path


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block, sandbox):
    if re.search(r"^\s*(import|from) (lightning|transformers|fastai)\b", block.code, re.M):
        _load_torchvision_shim()
    code = block.code.replace(DRIVE, str(sandbox / "drive"))
    namespace = {"__name__": "__docs__"}
    try:
        exec(compile(code, block.id, "exec"), namespace)
    finally:
        namespace.clear()
        gc.collect()  # the example's checkpointers (registered weakly) and threads go now
