"""The ways a ``for`` loop over a generator ends, each read by ``closed_by_break``: the child of
tests/test_break_detection.py, run by every Python found (it needs neither torch nor pytest, and loads
keepalive/callbacks/_torch_break.py by its path, so no other keepalive module is imported). Prints one
JSON object: {case: what closed_by_break said, or null when the generator was not closed}.
"""
import contextlib
import importlib.util
import json
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "keepalive", "callbacks",
                     "_torch_break.py")
_spec = importlib.util.spec_from_file_location("_torch_break", _PATH)
detect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(detect)

seen = []


def gen():
    """Stands for ``ckpt.epochs(n)``: reads the closing frame as the adapter does."""
    try:
        while True:
            yield 1
    except GeneratorExit:
        seen.append(detect.closed_by_break(sys._getframe(1)))
        raise


class Boom(Exception):
    pass


def a_break():
    for _ in gen():
        break


def a_break_after_a_call():
    for i in gen():
        print("", end="")  # an expression statement: a call, then a POP_TOP of its result
        if i:
            break


def a_return():
    for _ in gen():
        return


def a_return_with_a_value():
    for i in gen():
        return i * 2


def a_break_in_a_with():
    for _ in gen():
        with contextlib.suppress(Boom):
            break


def a_break_in_a_finally():
    for _ in gen():
        try:
            break
        finally:
            seen.append(None) or seen.pop()


def a_break_in_a_nested_loop():
    for _ in gen():
        for _ in range(3):
            pass
        break


def an_exception_caught_outside():
    try:
        for _ in gen():
            raise Boom
    except Boom:
        pass


def an_exception_from_a_call():
    def fail():
        raise Boom
    try:
        for _ in gen():
            fail()
    except Boom:
        pass


def a_keyboard_interrupt():
    try:
        for _ in gen():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass


def an_explicit_close():
    g = gen()
    next(g)
    g.close()


def a_del():
    g = gen()
    next(g)
    del g


def a_rebinding():
    g = gen()
    next(g)
    g = None  # noqa: F841 - dropping the reference is the case


def a_break_at_module_level():
    exec(compile("for _ in gen():\n    break\n", "<cell>", "exec"), {"gen": gen})


def an_error_at_module_level():
    with contextlib.suppress(Boom):
        exec(compile("for _ in gen():\n    raise Boom\n", "<cell>", "exec"), {"gen": gen, "Boom": Boom})


def a_break_under_a_tracer():
    """A debugger or coverage (sys.settrace; on 3.12+ that instruments the code)."""
    def tracer(frame, event, arg):
        return tracer
    sys.settrace(tracer)
    try:
        a_break()
    finally:
        sys.settrace(None)


def an_exception_under_a_tracer():
    def tracer(frame, event, arg):
        return tracer
    sys.settrace(tracer)
    try:
        an_exception_caught_outside()
    finally:
        sys.settrace(None)


def a_break_under_sys_monitoring():
    """3.12+: a tool watching every instruction (the bytecode runs instrumented)."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return a_break()
    tool = next(t for t in range(6) if monitoring.get_tool(t) is None)
    monitoring.use_tool_id(tool, "break-cases")
    events = monitoring.events.INSTRUCTION | monitoring.events.LINE
    for event in (monitoring.events.INSTRUCTION, monitoring.events.LINE):
        monitoring.register_callback(tool, event, lambda *a: None)
    monitoring.set_events(tool, events)
    try:
        a_break()
    finally:
        monitoring.set_events(tool, 0)
        monitoring.free_tool_id(tool)


def no_frame():
    seen.append(detect.closed_by_break(None))


def an_unreadable_frame():
    class Fake:
        f_lasti = 0
        f_code = None
    seen.append(detect.closed_by_break(Fake()))


def a_frame_not_started():
    class Fake:
        f_lasti = -1
        f_code = a_break.__code__
    seen.append(detect.closed_by_break(Fake()))


CASES = [a_break, a_break_after_a_call, a_return, a_return_with_a_value, a_break_in_a_with,
         a_break_in_a_finally, a_break_in_a_nested_loop, an_exception_caught_outside,
         an_exception_from_a_call, a_keyboard_interrupt, an_explicit_close, a_del, a_rebinding,
         a_break_at_module_level, an_error_at_module_level, a_break_under_a_tracer,
         an_exception_under_a_tracer, a_break_under_sys_monitoring, no_frame, an_unreadable_frame,
         a_frame_not_started]


def run_all():
    """{case name: what closed_by_break said (None when the generator was never closed)}."""
    said = {}
    for case in CASES:
        del seen[:]
        case()
        said[case.__name__] = seen[0] if len(seen) == 1 else (None if not seen else list(seen))
    return said


if __name__ == "__main__":
    print(json.dumps({"python": list(sys.version_info[:2]), "said": run_all()}))
