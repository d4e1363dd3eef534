"""Exceptions raised by torchsync_pass (pure Python, importable without torch)."""


class NosyncError(RuntimeError):
    """Base class for errors raised by the nosync backend."""


class NosyncOptionsError(NosyncError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` is unknown or ill-typed."""


class VerificationError(NosyncError):
    """Compiled output differs from eager (raised when ``verify`` and ``strict`` are on)."""

