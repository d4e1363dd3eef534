"""Symbolic sizes and the hoisting decision.

With ``dynamic=True`` (or after an automatic-dynamic recompile) Dynamo gives tensors symbolic sizes
``s0, s1, ...`` (sympy symbols in the ShapeEnv). A hoisted constant is specialised on the concrete
value computed from concrete leaves; if a leaf's size is symbolic, the same compiled graph serves
leaves of other sizes, for which the hoisted value would be stale unless the guard also pinned the
size. Rather than pin sizes that the user asked to keep dynamic, the pass rejects such cones and
says which symbols it saw.

Because the pass replaces a sync by a Python constant *before* Dynamo turns it into an unbacked
symbol, no ``u0``-style symbols or runtime asserts are created for a hoisted site: there is nothing
left to fold afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import sympy
import torch


def free_symbols_of(*values: Any) -> set[sympy.Symbol]:
    """Free sympy symbols in the sizes/strides/values of (fake) tensors and SymInts."""
    from ._torch_private import free_symbols

    out: set[sympy.Symbol] = set()
    for v in values:
        if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            with contextlib.suppress(Exception):  # tensors without a shape env
                out |= free_symbols(v)
        elif isinstance(v, (list, tuple)):
            out |= free_symbols_of(*v)
    return out


def describe(what: str, symbols: Iterable[sympy.Symbol], example: Any = None) -> str:
    names = sorted(str(s) for s in symbols)
    if isinstance(example, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(example, bool):
        # NOTE: a Python int/float input (e.g. a scheduler's ``self._step_index``) that Dynamo
        # turned into a symbol: after it changed between calls (automatic dynamic), or at once
        # under ``dynamic=True`` (review 21: the message said it had changed). It has no size.
        kind = "float" if isinstance(example, (float, torch.SymFloat)) else "int"
        sym = f" ({', '.join(names)})" if names else ""
        return (f"{what} is a Python {kind} that Dynamo made dynamic{sym} (dynamic=True, or it changed "
                f"between calls); the cone's value would change with it")
    if not names:
        return f"{what} is symbolic"
    return f"{what} has symbolic size(s) {', '.join(names)} (dynamic shapes)"

