"""Short tracebacks in IPython for the errors keepalive raises to tell the user something.

``RunLockedError``, ``StateMismatchError`` and the other classes of :mod:`keepalive.errors` carry one
message that says what happened and what to do; the 40 to 60 lines of traceback through the training
framework and keepalive's internals above it only hide that message. The same holds for the
``KeyboardInterrupt`` keepalive re-raises after saving on Ctrl-C / "Interrupt kernel" (it said what
it saved on the line before). In IPython (a notebook kernel or the terminal) these are shown as::

    RunLockedError: run 'pets' is being written by another live session ...
    (keepalive: %tb shows the full traceback)

An error marked as one line (:func:`keepalive.errors.in_one_line`: a checkpoint destination that
cannot be used at the start of training) is that one line, the hint at its end. ``%tb`` shows the
whole traceback of the last error; after ``%xmode Verbose`` (or with
``KEEPALIVE_VERBOSITY=debug``) every traceback is shown in full again. Every other exception is shown as
IPython shows it, through a custom handler registered before ours when there was one.

:func:`install` registers the handler with ``set_custom_exc``; ``%load_ext keepalive`` does, and so
does importing :mod:`keepalive` inside a running IPython (``keepalive/__init__.py`` asks whether
IPython is already imported and has a shell: the core never imports IPython).
"""
from __future__ import annotations

import types
from typing import Any, List, Optional, Tuple

from .. import errors, report

__all__ = ["install", "uninstall", "is_user_facing", "short_traceback", "installed", "HINT"]

#: the line under the short form
HINT = "(keepalive: %tb shows the full traceback)"

#: the module whose exception classes are user-facing: each one's message is the whole story
ERRORS_MODULE = errors.__name__


def _error_classes() -> Tuple[type, ...]:
    """Every exception class defined in :mod:`keepalive.errors` (new ones included, read at
    install time)."""
    return tuple(v for v in vars(errors).values()
                 if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == ERRORS_MODULE)


def _innermost_module(tb: Optional[types.TracebackType]) -> str:
    """The module the exception was raised in (the last frame of its traceback)."""
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return str(last.tb_frame.f_globals.get("__name__", "")) if last is not None else ""


def is_user_facing(value: BaseException, tb: Optional[types.TracebackType] = None) -> bool:
    """Whether ``value`` is one of keepalive's messages to the user: an instance of a class defined
    in :mod:`keepalive.errors` (checked by module name, so a class added there later counts too),
    or a ``KeyboardInterrupt`` raised by keepalive (it re-raises one after saving on Ctrl-C)."""
    if any(c.__module__ == ERRORS_MODULE for c in type(value).__mro__):
        return True
    if isinstance(value, KeyboardInterrupt):
        return _innermost_module(tb if tb is not None else value.__traceback__).startswith("keepalive.")
    return False


def _frame_names(tb: Optional[types.TracebackType]) -> List[str]:
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def short_traceback(shell: Any, etype: type, value: BaseException,
                    tb: Optional[types.TracebackType] = None) -> List[str]:
    """The short form: the exception's own lines as IPython colours them, then :data:`HINT`; one
    line for an error whose message is the whole story (:func:`keepalive.errors.in_one_line`: a
    destination that cannot be used at the start), the hint at its end."""
    if errors.is_one_line(value):
        return [f"{errors.one_line(value)} {HINT}"]
    try:
        lines = [ln.rstrip("\n") for ln in shell.InteractiveTB.get_exception_only(etype, value)]
    except Exception:  # noqa: BLE001 - a formatter that differs: plain text
        lines = [f"{etype.__name__}: {value}"]
    if isinstance(value, KeyboardInterrupt) and not str(value):
        if "_on_signal" in _frame_names(tb)[-3:]:  # interrupted twice: stopped where it was
            what = "stopped at once on the second interrupt; its newest checkpoint is kept"
        else:
            what = "keepalive saved (see the line above), then stopped the training"
        lines = [f"KeyboardInterrupt: {what}"]
    return lines + [HINT]


def _verbose(shell: Any) -> bool:
    """``%xmode Verbose`` or ``KEEPALIVE_VERBOSITY=debug``: the user asked for every traceback in full."""
    mode = getattr(getattr(shell, "InteractiveTB", None), "mode", "")
    return str(mode).lower() == "verbose" or report.verbosity() == "debug"


class _Handler:
    """The ``set_custom_exc`` handler, remembering what was registered before it."""

    def __init__(self, shell: Any):
        self.previous_types: Tuple[type, ...] = tuple(getattr(shell, "custom_exceptions", ()) or ())
        self.previous = getattr(shell, "CustomTB", None) if self.previous_types else None
        self.types = tuple(dict.fromkeys(self.previous_types + _error_classes() + (KeyboardInterrupt,)))

    def __call__(self, shell: Any, etype: type, value: BaseException, tb: Any,
                 tb_offset: Optional[int] = None) -> None:
        user_facing = is_user_facing(value, tb)
        if user_facing and _verbose(shell):  # in full, whatever the class renders by itself
            shell._get_exc_info((etype, value, tb))
            shell._showtraceback(etype, value, shell.InteractiveTB.structured_traceback(
                etype, value, tb, tb_offset=tb_offset))
            return None
        if not user_facing:
            if self.previous is not None and isinstance(value, self.previous_types):
                self.previous(etype, value, tb, tb_offset=tb_offset)
            else:  # as IPython's run_code shows any other exception
                shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
            return None
        shell._get_exc_info((etype, value, tb))  # sys.last_* for %tb and %debug
        shell._showtraceback(etype, value, short_traceback(shell, etype, value, tb))
        _full_on_the_next_render(shell, etype, value, tb)
        return None


def _full_on_the_next_render(shell: Any, etype: type, value: BaseException, tb: Any) -> None:
    """Make ``%tb`` show the whole traceback of an error just shown short. ``%tb`` goes through
    ``showtraceback``, which asks the exception to render itself when it can
    (``_render_traceback_``; a class may render itself short, as its first display). This instance,
    already shown short, renders the full traceback from now on (set on the instance, so the class
    and every other error keep their own behaviour)."""
    def full() -> List[str]:
        return list(shell.InteractiveTB.structured_traceback(etype, value, tb))

    try:
        value._render_traceback_ = full  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an exception with __slots__: %tb shows what its class gives
        pass


def installed(shell: Any) -> Optional[_Handler]:
    """Our handler when it is the shell's custom exception handler, else None."""
    handler = getattr(shell, "_keepalive_traceback_handler", None)
    return handler if isinstance(handler, _Handler) and shell.custom_exceptions == handler.types else None


def install(shell: Any) -> bool:
    """Show keepalive's user-facing errors in ``shell`` in their short form (idempotent). False
    where the shell cannot take a custom handler."""
    if shell is None or not hasattr(shell, "set_custom_exc") or installed(shell) is not None:
        return installed(shell) is not None if shell is not None else False
    handler = _Handler(shell)
    try:
        shell.set_custom_exc(handler.types, handler)
    except Exception:  # noqa: BLE001 - a shell without the hook keeps IPython's tracebacks
        return False
    shell._keepalive_traceback_handler = handler
    return True


def uninstall(shell: Any) -> None:
    """Give the shell back the custom handler it had before :func:`install` (``%unload_ext``)."""
    handler = installed(shell)
    if handler is None:
        return
    if handler.previous is not None:
        shell.CustomTB, shell.custom_exceptions = handler.previous, handler.previous_types
    else:
        shell.set_custom_exc((), None)
    shell._keepalive_traceback_handler = None
