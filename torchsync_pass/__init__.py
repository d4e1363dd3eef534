"""torchsync_pass: remove request-invariant host syncs from per-step loops under torch.compile.

    step = torch.compile(step, backend="nosync")
    with torchsync_pass.count_syncs() as c:
        step(x, t, token_types)
    c.total, c.by_site

Importing this package is cheap: the backend, the Dynamo hooks and the profiler-based counter are
loaded on first use. The backend name ``nosync`` is registered through the
``torch_dynamo_backends`` entry point when the package is installed, and directly at import
otherwise (see ``_ensure_registered``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .report import Action, Decision, Reason, SiteKey, decisions

__version__ = "0.1.0"

_LAZY = {
    "count_syncs": "counting",
    "SyncCounts": "counting",
    "verify_loop": "loop",
    "LoopReport": "loop",
    "VerificationError": "errors",
    "NosyncError": "errors",
    "NosyncOptionsError": "errors",
    "nosync": "backend",
    "NosyncBackend": "backend",
    "reset": "backend",
    "keep_nosync_guards": "backend",
    "TORCH_REQUIREMENT": "dynamo_hooks",
    "check_request": "serving",
    "RequestCheck": "serving",
    "HoistedValueChanged": "serving",
    "HoistedValueUnchecked": "serving",
}

__all__ = ["Action", "Decision", "Reason", "SiteKey", "decisions", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'torchsync_pass' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    try:
        return "nosync" in entry_points(group="torch_dynamo_backends").names
    except Exception:  # pragma: no cover - broken metadata
        return False


def _ensure_registered() -> None:
    """Make ``torch.compile(backend="nosync")`` work in both import orders.

    NOTE: when Dynamo resolves "nosync" through the entry point it imports this package and then
    calls ``register_backend(name="nosync")`` itself; registering here as well would make that call
    fail with ``duplicate name: nosync``. So register only when no entry point will do it (a source
    checkout that was not pip-installed) and the name is not already known.
    """
    if _entry_point_installed():
        return
    from ._torch_private import register_backend

    register_backend("nosync", lambda: importlib.import_module(".backend", __name__).nosync)


def _register_log_name() -> None:
    """``torch._logging.set_logs(modules={"nosync": logging.INFO})`` works right after import.

    NOTE: torch parses the TORCH_LOGS environment variable when torch itself is imported, before any
    third-party package can register a name, so from the environment use the module form,
    ``TORCH_LOGS=torchsync_pass`` (``+torchsync_pass`` for debug).
    """
    try:
        from ._torch_private import register_log_alias

        register_log_alias("nosync", ["torchsync_pass"])
    except Exception:  # logging integration is best effort
        pass


_ensure_registered()
_register_log_name()
