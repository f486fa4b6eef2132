"""Inductor's generated code: get it, FileCheck it, and check what a transfer's buffers do in
flight. A rewrite that is right in the FX graph can still be wrong in the code that runs."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["buffers_in_flight_violations", "check_code", "inductor_code"]

_DIRECTIVE = re.compile(r"^\s*#?\s*(CHECK(?:-[A-Z]+(?:-\d+)?)?:.*)$")


def inductor_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()``'s result and the wrapper code of every graph inductor compiled while it ran
    (``torch._inductor.utils.run_and_get_code``), with inductor's caches off, so that nothing
    compiled earlier is reused unseen."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    with fresh_cache():
        return run_and_get_code(fn)


def check_code(code: str, checks: str) -> None:
    """Assert that ``code`` passes ``torch.testing.FileCheck`` with ``checks``: one directive per
    line (``CHECK:``, ``CHECK-NEXT:``, ``CHECK-NOT:``, ``CHECK-SAME:``, ``CHECK-COUNT-n:``,
    ``CHECK-DAG:``), each matched in order; a leading ``#`` is optional. Fails with FileCheck's
    message: what it looked for, and from where."""
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
    """Where inductor's generated wrapper ``code`` lets a ring transfer's send buffer die, be
    reused or be written between the transfer's start and its wait, or waits on other buffers
    than it sent; an empty list when none.

    Reads the wrapper as ``torch._inductor.utils.run_and_get_code`` returns it: a buffer is
    freed by ``del``, handed on by ``# reuse`` (``bufB = bufA; del bufA``), and written by a C++
    kernel at a non-``const`` pointer argument or by an extern kernel's ``out=``.
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
