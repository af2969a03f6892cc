"""Kaggle version chaining (opt-in): a training longer than a Kaggle session, continued by the
notebook's next version without a person.

A Kaggle batch version ("Save & Run All") runs for at most 12 h (9 h on a TPU); its ``/kaggle/working``
is kept as the version's output, which a later version can mount read-only under ``/kaggle/input``.
With ``KEEPALIVE_KAGGLE_CHAIN=<most versions>`` and ``KEEPALIVE_KAGGLE_NOTEBOOK=<owner>/<slug>``, when
keepalive stops a training for the session's deadline (after its final, durable save into
``/kaggle/working``), it pushes the next version of the same notebook through Kaggle's official client
(``kagglesdk``, which the ``kaggle`` package's ``kernels push`` uses): the notebook's source and
settings as Kaggle holds them, with the notebook's own output added as a data source. The next version
finds its working folder empty and resumes from the same run in that output, read only
(:mod:`keepalive.resumefrom`), writing to its new ``/kaggle/working``.

The chain is bounded: each push is recorded in ``keepalive-kaggle-chain.json`` in the working folder
(the version, when, at which step), which the next version reads from its input; a push beyond the
most versions is not made, and said. Each push is said and notified (``KEEPALIVE_NOTIFY``).

The API token is read where Kaggle's client reads it (``KAGGLE_API_TOKEN``, ``~/.kaggle/access_token``,
``~/.kaggle/kaggle.json``, and ``KAGGLE_USERNAME`` / ``KAGGLE_KEY``): keepalive never stores it (not in
a checkpoint, not in the chain record) and never prints it. ``KAGGLE_API_ENVIRONMENT`` (the client's
own setting) points the client at another endpoint (tests: a stand-in of the API on 127.0.0.1).

>>> with_own_output({"kernel_sources": ["a/b"]}, "me/train")["kernel_sources"]
['a/b', 'me/train']
"""
from __future__ import annotations

import glob
import json
import os
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from . import report, settings
from .session import platforms

__all__ = ["CHAIN_FILE", "ChainListener", "attach", "chain_length", "opted_in", "push_next_version",
           "with_own_output"]

#: the chain's record, in the working folder (so in each version's output)
CHAIN_FILE = "keepalive-kaggle-chain.json"
#: how deep below the input folder a notebook's output may be mounted
_INPUT_DEPTH = 3
#: the checkpointers whose run is chained
_ATTACHED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def opted_in() -> Optional[Tuple[str, int]]:
    """``(notebook, most versions)`` when chaining is asked for on Kaggle, else None."""
    most, notebook = settings.get("KEEPALIVE_KAGGLE_CHAIN"), settings.get("KEEPALIVE_KAGGLE_NOTEBOOK")
    if not most or platforms.detect().platform != "kaggle":
        return None
    if not notebook or notebook.count("/") != 1:
        report.warn("KEEPALIVE_KAGGLE_CHAIN is set but KEEPALIVE_KAGGLE_NOTEBOOK is not <owner>/<slug> (the "
                    "last two parts of the notebook's URL): no version will be pushed", key="kaggle-chain-notebook")
        return None
    return str(notebook), int(most)


def _records(working: str, input_root: str) -> List[Dict[str, Any]]:
    paths = [os.path.join(working, CHAIN_FILE)]
    paths += [p for depth in range(1, _INPUT_DEPTH + 1)
              for p in glob.glob(os.path.join(input_root, *("*",) * depth, CHAIN_FILE))]
    found = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("pushes"), list):
            found.append(record)
    return found


def chain_length(working: str, input_root: str) -> Tuple[int, List[Dict[str, Any]]]:
    """How many versions the chain has pushed so far, and their records (the longest record found in
    the working folder or a mounted output)."""
    pushes: List[Any] = max((r["pushes"] for r in _records(working, input_root)), key=len, default=[])
    return len(pushes), list(pushes)


def with_own_output(metadata: Dict[str, Any], notebook: str) -> Dict[str, Any]:
    """The notebook's settings with its own output among its data sources."""
    sources = list(metadata.get("kernel_sources") or [])
    if notebook not in sources:
        sources.append(notebook)
    return dict(metadata, kernel_sources=sources)


def _client() -> Any:
    """Kaggle's client with the credentials where Kaggle's tools read them (the token itself is never
    read by keepalive, except a legacy user name and key from the environment, handed on)."""
    try:
        from kagglesdk import KaggleClient
    except ImportError:
        raise RuntimeError("Kaggle's client is not installed: pip install kaggle (or keepalive-nb[kaggle])") from None

    return KaggleClient(username=os.environ.get("KAGGLE_USERNAME"), password=os.environ.get("KAGGLE_KEY"))


def _save_request(source: Any, meta: Any, notebook: str) -> Any:
    from kagglesdk.kernels.types.kernels_api_service import ApiSaveKernelRequest

    settings_now = with_own_output({"kernel_sources": list(meta.kernel_data_sources or [])}, notebook)
    request = ApiSaveKernelRequest()
    request.slug = notebook
    request.text = source.source
    request.language = meta.language or source.language
    request.kernel_type = meta.kernel_type or source.kernel_type
    request.is_private = meta.is_private
    request.enable_gpu, request.enable_tpu = meta.enable_gpu, meta.enable_tpu
    request.enable_internet = meta.enable_internet
    request.dataset_data_sources = list(meta.dataset_data_sources or [])
    request.competition_data_sources = list(meta.competition_data_sources or [])
    request.model_data_sources = list(meta.model_data_sources or [])
    request.kernel_data_sources = settings_now["kernel_sources"]
    if meta.machine_shape:
        request.machine_shape = meta.machine_shape
    return request


def push_next_version(notebook: str, most: int, *, step: Optional[int] = None, working: Optional[str] = None,
                      input_root: Optional[str] = None, notify: Any = None) -> Optional[int]:
    """Push the next version of ``notebook`` with its own output as a data source, unless the chain
    has ``most`` versions already; record the push in the working folder. Returns the new version's
    number (0 when Kaggle did not say it), None when nothing was pushed. ``notify``: the training's
    ``notify=`` URLs (default ``KEEPALIVE_NOTIFY``), told of the push or of the chain's end."""
    working = working or str(settings.get("KEEPALIVE_KAGGLE_WORKING"))
    input_root = input_root or str(settings.get("KEEPALIVE_KAGGLE_INPUT"))
    done, pushes = chain_length(working, input_root)
    if done >= most:
        _tell(f"Kaggle chain: {done} version(s) pushed already (KEEPALIVE_KAGGLE_CHAIN={most}): the next version "
              f"of {notebook} is not pushed; run it by hand to continue", "warning", notify)
        return None
    from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

    owner, slug = notebook.split("/")
    with _client() as kaggle:
        ask = ApiGetKernelRequest()
        ask.user_name, ask.kernel_slug = owner, slug
        found = kaggle.kernels.kernels_api_client.get_kernel(ask)
        answer = kaggle.kernels.kernels_api_client.save_kernel(_save_request(found.blob, found.metadata, notebook))
    if answer.error:
        raise RuntimeError(f"Kaggle refused the push of {notebook}: {answer.error}")
    version = int(answer.version_number or 0)
    pushes.append({"notebook": notebook, "version": version, "time": time.time(), "step": step})
    with open(os.path.join(working, CHAIN_FILE), "w", encoding="utf-8") as f:
        json.dump({"notebook": notebook, "pushes": pushes}, f, indent=1)
    _tell(f"Kaggle chain: pushed version {version or '?'} of {notebook} ({done + 1} of {most}); it resumes from "
          f"this version's output{f' at step {step}' if step is not None else ''}", "info", notify)
    return version


def _tell(line: str, kind: str, notify: Any) -> None:
    (report.say if kind == "info" else report.warn)(line)
    try:
        from .notify import notifier_from
    except ImportError:  # a keepalive without its notifications: said all the same
        return
    notifier = notifier_from(notify)
    if notifier is not None:
        notifier.send("keepalive: Kaggle chain", line, kind=kind)
        notifier.flush()


class ChainListener:
    """Told the run's events (:mod:`keepalive.lifecycle.events`): pushes the next version when the
    training stops for the session's deadline."""

    def __init__(self, notebook: str, most: int):
        self.notebook, self.most = notebook, most

    def started(self, ckpt: Any, resumed_from: Any) -> None:
        pass

    def stepped(self, ckpt: Any) -> None:
        pass

    def saved(self, ckpt: Any, result: Any) -> None:
        pass

    def ended(self, ckpt: Any, outcome: str, reason: str) -> None:
        if outcome != "stopped" or not getattr(ckpt.trigger, "deadline_hit", False):
            return  # finished, crashed, or stopped by a signal or a notice: not the session's end
        if os.path.relpath(os.path.abspath(ckpt.url), os.path.abspath(settings.get("KEEPALIVE_KAGGLE_WORKING"))
                           ).startswith(".."):
            report.warn(f"Kaggle chain: the run {ckpt.url} is not under the working folder, which the next version "
                        "gets as its input: no version pushed", key="kaggle-chain-outside")
            return
        try:
            ckpt.flush()  # the final save is in the working folder before the next version is asked for
            push_next_version(self.notebook, self.most, step=ckpt.state.counters.as_dict().get("step"),
                              notify=getattr(ckpt.config, "notify", None))
        except Exception as exc:  # noqa: BLE001 - the stop stands; the chain is said to be broken
            report.warn(f"Kaggle chain: the next version of {self.notebook} could not be pushed "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); run it by hand "
                        "to continue", key="kaggle-chain-failed")


def attach(ckpt: Any) -> None:
    """Chain this checkpointer's run when asked to (once per checkpointer)."""
    chosen = opted_in()
    if chosen is None or ckpt in _ATTACHED:
        return
    _ATTACHED.add(ckpt)
    ckpt.events.subscribe(ChainListener(*chosen))
