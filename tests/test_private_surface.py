"""The private torch surface lives in one place (issue 10).

Every private torch name the package uses (``torch._dynamo``, ``torch.utils._pytree``,
``torch.fx.experimental``, Dynamo's node-meta keys, ``._cdata``, ``kineto_results`` ...) must sit in
``dynamo_hooks.py`` (the hook points) or ``_torch_private.py`` (the rest, with the release table),
so that a new torch release is the work of those files. The scan reads the code (AST), not the
comments and docstrings.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchsync_pass"
OWNERS = {"dynamo_hooks.py", "_torch_private.py"}

PRIVATE_ATTRS = {"_cdata", "kineto_results", "_dynamo_source", "_is_profiler_enabled", "_RecordFunctionFast"}
DYNAMO_META_KEYS = {"grapharg", "example_value", "tensor_dict"}
PRIVATE_PREFIXES = ("torch.fx.experimental",)


def _private_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "torch":
        return False
    private = [p for p in parts[1:] if p.startswith("_") and not p.endswith("__")]  # not __version__
    return bool(private) or name.startswith(PRIVATE_PREFIXES)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_uses(source: str) -> list[str]:
    """``line: name`` for each private torch name the code (not its strings) uses."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = None
        if isinstance(node, ast.Import):
            hit = next((a.name for a in node.names if _private_module(a.name)), None)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = [a.name for a in node.names]
            if _private_module(node.module) or any(n.startswith("_") for n in names):
                hit = f"{node.module}: {', '.join(names)}"
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if node.attr in PRIVATE_ATTRS or (dotted and _private_module(dotted)):
                hit = dotted or node.attr
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value in DYNAMO_META_KEYS:
                hit = f'["{node.slice.value}"]'
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and arg.value in DYNAMO_META_KEYS:
                hit = f'.get("{arg.value}")'
        if hit:
            found.append(f"{node.lineno}: {hit}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _modules() -> dict[str, list[str]]:
    return {p.name: private_uses(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}


@pytest.mark.parametrize(
    "code",
    [
        "import torch._dynamo",
        "from torch._dynamo.utils import counters",
        "from torch.utils._pytree import tree_map",
        "from torch.fx.experimental.symbolic_shapes import free_symbols",
        "from torch.autograd.profiler import _is_profiler_enabled",
        "x = torch._C._profiler",
        "n = t.untyped_storage()._cdata",
        "r = prof.kineto_results",
        "g = node.meta['grapharg']",
        "g = node.meta.get('example_value')",
    ],
)
def test_scanner_finds_each_kind_of_private_name(code):
    assert private_uses(code), code


def test_scanner_ignores_public_names_comments_and_docstrings():
    code = '"""uses torch._dynamo.reset()"""\nimport torch\n# torch._C\nx = torch.fx.Node\ny = t._version, torch.__version__\n'
    assert private_uses(code) == []


def test_private_torch_names_only_in_their_own_modules():
    found = _modules()
    outside = {m: uses for m, uses in found.items() if uses and m not in OWNERS}
    assert not outside, "private torch names outside dynamo_hooks.py/_torch_private.py:\n" + "\n".join(
        f"  {m}:{u}" for m, uses in outside.items() for u in uses
    )
    assert found["_torch_private.py"] and found["dynamo_hooks.py"]  # the owners are scanned too

