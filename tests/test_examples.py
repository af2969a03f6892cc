"""Every ``examples/*.ipynb`` runs top to bottom under nbclient in a real kernel, without an error.

Generic: each notebook found is one test. Its framework comes from the notebook's metadata
(``{"keepalive": {"framework": "torch", "test_timeout": 240}}``), else from its file name prefix
(``torch_`` / ``keras_`` / ``fastai_``), else from the adapter it imports; the notebook is skipped only
when that framework cannot be imported here. Each notebook gets its own timeout (metadata
``test_timeout``, default 300 s), a temporary working directory and its own ``KEEPALIVE_DIR``.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

from kernelkit import kernelspec  # noqa: E402  (tests/kernelkit.py)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NOTEBOOKS = sorted(glob.glob(os.path.join(EXAMPLES, "*.ipynb")))
DEFAULT_TIMEOUT = 300
FRAMEWORK_MODULES = {"torch": ["torch"], "keras": ["keras"], "fastai": ["fastai", "torch"],
                     "lightning": ["lightning", "torch"], "tensorflow": ["tensorflow"],
                     "transformers": ["transformers", "torch"]}

# The registry's torchvision is a CUDA build: next to the CPU torch here, `import torchvision` fails
# with "operator torchvision::nms does not exist" unless the op schemas exist first (see DESIGN.md).
# Tests only: prepended to notebooks that use torchvision (fastai does) when the plain import fails.
TORCHVISION_SHIM = """\
import torch
for _name in ("torchvision::nms", "torchvision::qnms"):
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:
        pass
"""


def _meta(nb) -> dict:
    return dict(nb.metadata.get("keepalive") or {})


def framework_of(path: str, nb) -> str:
    fw = _meta(nb).get("framework")
    if fw:
        return fw
    prefix = os.path.basename(path).split("_", 1)[0]
    if prefix in FRAMEWORK_MODULES:
        return prefix
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for fw in ("fastai", "keras", "lightning", "transformers", "torch"):
        if f"keepalive.callbacks.{fw}" in source:
            return fw
    return "none"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


_TV_OK = None


def torchvision_imports() -> bool:
    global _TV_OK
    if _TV_OK is None:
        if not _importable("torchvision"):
            _TV_OK = True  # nothing to shim
        else:
            probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True,
                                   timeout=120)
            _TV_OK = probe.returncode == 0
    return _TV_OK


def _params():
    out = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        timeout = int(_meta(nb).get("test_timeout", DEFAULT_TIMEOUT))
        out.append(pytest.param(path, id=os.path.basename(path),
                                marks=pytest.mark.timeout(timeout + 120)))
    return out


def test_there_are_examples():
    assert any(os.path.basename(p).startswith("torch_") for p in NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("path", _params())
def test_example_notebook_runs_cleanly(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    fw = framework_of(path, nb)
    for mod in FRAMEWORK_MODULES.get(fw, []):
        if not _importable(mod):
            pytest.skip(f"{os.path.basename(path)} needs {mod} ({fw}), which is not installed")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    if ("torchvision" in code or fw in ("fastai", "transformers", "lightning")) and not torchvision_imports():
        nb.cells.insert(0, nbformat.v4.new_code_cell(TORCHVISION_SHIM))
    timeout = int(_meta(nb).get("test_timeout", DEFAULT_TIMEOUT))
    env = dict(os.environ, KEEPALIVE_DIR=str(tmp_path / "checkpoints"), KEEPALIVE_PROGRESS="0",
               IPYTHONDIR=str(tmp_path / "ipython"), OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"), TF_CPP_MIN_LOG_LEVEL="2")
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernelspec(), allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)   # raises CellExecutionError naming the failing cell

    errors, stderr = [], []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                errors.append(f"{output.get('ename')}: {output.get('evalue')}")
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                stderr.append(output.get("text", ""))
    assert not errors, errors
    assert "Traceback" not in "".join(stderr), "".join(stderr)
    # the run was checkpointed under the test's KEEPALIVE_DIR and finished
    from keepalive.magics import scan_runs

    runs = scan_runs(str(tmp_path / "checkpoints"))
    assert runs and all(r.newest is not None for r in runs), runs
    assert all(r.finished for r in runs), [(r.run, r.where()) for r in runs]
