"""Test-only shim, put on PYTHONPATH of child processes that import torchvision (fastai.vision does).

The registry's torchvision 0.28.0 is a CUDA build: next to the CPU torch of the test machine,
``import torchvision`` fails with "operator torchvision::nms does not exist" unless the op schemas
exist first (see DESIGN.md). This registers them right before torchvision is first imported (an
import hook: processes that never import torchvision do not pay for importing torch here).
Never part of the package: on a user's machine torchvision imports normally.
"""
import importlib.abc
import sys

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _define_ops() -> None:
    import torch

    for name in ("torchvision::nms", "torchvision::qnms"):
        try:
            torch.library.define(name, _SCHEMA)
        except Exception:  # noqa: BLE001 - already defined (a CPU torchvision, or twice)
            pass


class _TorchvisionShim(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_ops()
        return None  # the normal finders import it


if "torchvision" not in sys.modules:
    sys.meta_path.insert(0, _TorchvisionShim())
