"""Inductor's generated code: get it, FileCheck it, and check what a transfer's buffers do in
flight. A rewrite that is right in the FX graph can still be wrong in the code that runs."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["buffers_in_flight_violations", "check_code", "inductor_code"]

_DIRECTIVE = re.compile(r"^\s*#?\s*(CHECK(?:-[A-Z]+(?:-\d+)?)?:.*)$")


def inductor_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``fn()`` and return its result and the code inductor generated while it ran.

    A wrapper of ``torch._inductor.utils.run_and_get_code`` under ``fresh_cache()``: inductor's
    caches are off, so nothing compiled earlier is reused unseen. ``fn`` must compile through
    inductor (``compiler="inductor"``, the default) for there to be code.

    Args:
        fn (Callable[[], Any]): runs the compiled model (forward, and backward if wanted).

    Returns:
        tuple[Any, list[str]]: ``fn()``'s result and the wrapper code of every graph inductor
        compiled, in compile order.

    Example::

        compiled = torch.compile(attend, backend=ring_rewrite.backend(segment_lengths=[64, 256],
                                                                      dilation_rates=[1, 4]))
        out, codes = inductor_code(lambda: compiled(q, k, v))
        assert all(not buffers_in_flight_violations(code) for code in codes)
    """
    from torch._inductor.utils import fresh_cache, run_and_get_code

    with fresh_cache():
        return run_and_get_code(fn)


def check_code(code: str, checks: str) -> None:
    """Assert that ``code`` passes ``torch.testing.FileCheck`` with ``checks``.

    ``checks`` holds one directive per non-blank line (``CHECK:``, ``CHECK-NEXT:``,
    ``CHECK-NOT:``, ``CHECK-SAME:``, ``CHECK-COUNT-n:``, ``CHECK-DAG:``), matched in order; a
    leading ``#`` is optional. Use it on inductor's code where the order of the code that runs
    matters (a transfer's start before the block that overlaps it, its wait after).

    Args:
        code (str): the text to check, such as one of ``inductor_code``'s wrapper codes.
        checks (str): the FileCheck directives, one a line.

    Returns:
        None.

    Raises:
        ValueError: a line that is not a FileCheck directive, or no directive at all.
        AssertionError: ``code`` fails the checks (FileCheck's message: what it looked for,
            and from where).

    Example::

        check_code(codes[0], '''
            CHECK: ring_rewrite.ring_shift_start.default
            CHECK: ring_rewrite.ring_shift_wait.default
        ''')
    """
    __tracebackhide__ = True
    from torch.testing import FileCheck

    lines = [line for line in checks.splitlines() if line.strip()]
    bad = [line for line in lines if not _DIRECTIVE.match(line)]
    if bad or not lines:
        raise ValueError(f"check_code: not a FileCheck directive: {bad or checks!r}")
    directives = "\n".join("# " + _DIRECTIVE.match(line).group(1) for line in lines)
    try:
        FileCheck().run(directives, code)
    except RuntimeError as error:
        raise AssertionError(f"inductor's code fails the checks\n{directives}\n\n{error}") from None

_CODE_START = re.compile(r"ring_rewrite\.ring_shift_start\.default\(\[([^\]]*)\], .*, (\d+)\)$")
_CODE_WAIT = re.compile(r"ring_rewrite\.ring_shift_wait\.default\(\[([^\]]*)\], [\w.]+, (\d+), \[")
_CODE_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(\[([^\]]*)\]")
_CODE_CALL = re.compile(r"^\s*(\w+)\((.*)\)\s*$")
_CODE_ALIAS = re.compile(r"^\s*\w+ = (?:reinterpret_tensor\()?(\w+)[,;)]")
_CODE_DEL = re.compile(r"\bdel (\w+)")
_CODE_OUT = re.compile(r"\bout=(\w+)")


def buffers_in_flight_violations(code: str) -> list[str]:
    """Where inductor's wrapper ``code`` breaks a ring transfer's buffers in flight.

    Every buffer a transfer sends must stay alive and unwritten from its start
    (``ring_shift_start``) to its wait (``ring_shift_wait``), and the wait must read the
    buffers its start sent (Note [Buffers in flight]). Reads the
    wrapper as ``torch._inductor.utils.run_and_get_code`` returns it: a buffer is freed by
    ``del``, handed on by ``# reuse`` (``bufB = bufA; del bufA``), and written by a C++ kernel
    at a non-``const`` pointer argument or by an extern kernel's ``out=``. Also reports a
    wait without a start and a transfer never waited for.

    Args:
        code (str): one wrapper code, as ``inductor_code`` returns them.

    Returns:
        list[str]: one line per violation, naming the buffer, the tag and the code line; empty
        when there is none.

    Example::

        out, codes = inductor_code(lambda: compiled(q, k, v).sum().backward())
        for code in codes:
            assert not buffers_in_flight_violations(code)

    .. warning::
        Knows which arguments a C++ (CPU) kernel writes from its signature only: what a
        Triton (CUDA) kernel writes is not seen, and it has not been run on CUDA code.
    """
    outputs: dict[str, list[bool]] = {}  # kernel -> per argument: is it written?
    in_flight: dict[str, tuple[str, ...]] = {}  # tag -> buffers sent
    problems = []
    for number, line in enumerate(code.splitlines(), 1):
        where = f"line {number}: {line.strip()}"
        if kernel := _CODE_KERNEL.match(line):
            types = [t.strip().strip("'\"") for t in kernel.group(2).split(",")]
            outputs[kernel.group(1)] = [not t.startswith("const") for t in types]
            continue
        if start := _CODE_START.search(line):
            in_flight[start.group(2)] = tuple(_names(start.group(1)))
            continue
        if wait := _CODE_WAIT.search(line):
            sent = in_flight.pop(wait.group(2), None)
            if sent is None:
                problems.append(f"a wait without a start (tag {wait.group(2)}), {where}")
            elif tuple(_names(wait.group(1))) != sent:
                problems.append(f"the wait reads other buffers than its start sent {sent}, {where}")
            continue
        busy = {name: tag for tag, names in in_flight.items() for name in names}
        if not busy:
            continue
        touched = set(_CODE_DEL.findall(line)) | set(_CODE_OUT.findall(line))
        if (alias := _CODE_ALIAS.match(line)) and "# reuse" in line:
            touched.add(alias.group(1))
        if (call := _CODE_CALL.match(line)) and call.group(1) in outputs:
            args = [a.strip() for a in call.group(2).split(",")]
            touched |= {a for a, out in zip(args, outputs[call.group(1)]) if out}
        for name in sorted(touched & set(busy)):
            problems.append(f"{name}, in flight (tag {busy[name]}), is freed or written, {where}")
    problems += [f"transfer {tag} of {sent} is never waited for" for tag, sent in in_flight.items()]
    return problems


def _names(listed: str) -> list[str]:
    """Buffer names in a wrapper's list argument, views included (``reinterpret_tensor(buf3,
    (..), (..), 0)`` is ``buf3``)."""
    return [x for x in re.findall(r"\b[A-Za-z_]\w*\b", listed) if x != "reinterpret_tensor"]
