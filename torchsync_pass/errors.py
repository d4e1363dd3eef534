"""Exceptions raised by torchsync_pass (pure Python, importable without torch)."""


class NosyncError(RuntimeError):
    """Base class for errors raised by the nosync backend."""


class NosyncOptionsError(NosyncError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` is unknown or ill-typed."""


class VerificationError(NosyncError):
    """Compiled output differs from eager (raised when ``verify`` and ``strict`` are on)."""



def never_silent(strict: bool, warned: list, msg: str) -> None:
    """Something nosync could not do: ``NosyncError`` under ``strict``; else a warning (once per
    process and kind: ``warned``, a list the caller keeps) and a log line each time."""
    import logging
    import warnings

    if strict:
        raise NosyncError(msg)
    if not warned:
        warned.append(True)
        warnings.warn(msg, stacklevel=3)
    logging.getLogger("torchsync_pass").warning(msg)
