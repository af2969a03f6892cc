"""Are we in a notebook? The one place that answers it, without importing IPython.

A process that never imported IPython runs no IPython shell, so ``sys.modules`` is asked, never
``import IPython`` (which would cost a second and pull in a large tree for every plain script).

* :func:`ipython_shell` — the running shell object, or None.
* :func:`in_notebook` — a notebook front end: a kernel shell (ipykernel's ``ZMQInteractiveShell``
  or a subclass, e.g. Colab's), as opposed to terminal IPython or plain Python.
* :func:`in_kernel` — this process is an IPython kernel (true even before a shell exists).
* :func:`frontend_name` — which front end (``colab``, ``kaggle``, ``vscode``, ``jupyter``, ...) for
  ``SessionInfo.frontend``.

>>> in_notebook(object())   # any shell that is not a kernel shell
False
"""
from __future__ import annotations

import sys
from typing import Any, Mapping, Optional

__all__ = ["ipython_shell", "in_notebook", "in_kernel", "is_notebook_shell", "frontend_name"]


def ipython_shell() -> Optional[Any]:
    """The IPython shell running in this process, or None (IPython is never imported here)."""
    module = sys.modules.get("IPython")
    if module is None:
        return None
    try:
        return module.get_ipython()
    except Exception:  # noqa: BLE001 - a half-imported or broken IPython: no shell
        return None


def is_notebook_shell(ip: Any) -> bool:
    """``ip`` is a kernel shell (ipykernel's ZMQInteractiveShell or a subclass, e.g. Colab's)."""
    return ip is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(ip).__mro__)


def in_notebook(ip: Any = None) -> bool:
    """True when code runs under a notebook front end: the shell ``ip`` (default: the running one)
    is a kernel shell. False in terminal IPython and in plain Python."""
    return is_notebook_shell(ipython_shell() if ip is None else ip)


def in_kernel() -> bool:
    """True inside an IPython kernel process (without importing anything)."""
    if "ipykernel" not in sys.modules:
        return False
    app_mod = sys.modules.get("ipykernel.kernelapp")
    try:
        return bool(app_mod and app_mod.IPKernelApp.initialized())
    except Exception:  # noqa: BLE001
        return False


def frontend_name(env: Mapping[str, str], platform: str, kernel: bool) -> str:
    """Which front end shows this session: ``colab``, ``kaggle``, ``vscode``, ``pycharm``,
    ``jupyter``, ``ipykernel`` (a kernel, front end unknown), ``ipython`` (terminal) or ``python``."""
    if platform == "colab":
        return "colab"
    if platform == "kaggle":
        return "kaggle"
    if kernel:
        if env.get("VSCODE_PID"):
            return "vscode"
        if env.get("PYCHARM_HOSTED"):
            return "pycharm"
        if env.get("JPY_SESSION_NAME") or env.get("JPY_PARENT_PID") or env.get("JUPYTER_SERVER_ROOT"):
            return "jupyter"
        return "ipykernel"
    if ipython_shell() is not None:
        return "ipython"
    return "python"
