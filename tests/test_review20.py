"""Review 20 (2026-12-07): each test failing on the commit before its fix."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import torchsync_pass
from torchsync_pass import NosyncOptionsError


def _rebuilds_args(func):
    """A ``functools.wraps`` decorator whose wrapper rebuilds its ``*args`` (as transformers 5's
    ``@merge_with_config_defaults`` on every model's ``forward``): its own names count."""
    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        if len(args) > 5:
            args = tuple(args)
        return func(self, *args, **kwargs)
    return wrapper


class _Wrapped(torch.nn.Module):
    @_rebuilds_args
    def forward(self, x, mask):
        return x * (mask.float().cumsum(-1) * 0.5).exp()


def _run_wrapped(invariant: list, strict: bool = False) -> tuple:
    torch._dynamo.reset()
    torchsync_pass.reset()
    counters.clear()
    model = _Wrapped()
    step = torch.compile(model, backend="nosync",
                         options={"codegen": "eager", "invariant": invariant, "strict": strict})
    mask = torch.tensor([1, 0, 1, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4)
            assert torch.equal(step(x, mask=mask), model(x, mask=mask))
    return counters["nosync"].get("cached", 0), [str(w.message) for w in caught if "nosync" in str(w.message)]


@pytest.fixture
def _clean():
    yield
    torch._dynamo.reset()
    torchsync_pass.reset()


def test_a_wraps_wrapper_that_rebuilds_args_is_the_function_whose_names_count(_clean):
    """Such a wrapper was taken for a decorator without functools.wraps (it passes ``*args`` on to
    a callable it closes over): no function was found for the names, so ``kwargs.mask`` declared
    nothing (nothing cached), and a name that names nothing got no warning, nor an error under
    strict."""
    cached, warned = _run_wrapped(["kwargs.mask"])
    assert cached == 1 and not warned
    cached, warned = _run_wrapped(["nonexistent_name"])
    assert cached == 0 and len(warned) == 1 and "'nonexistent_name'" in warned[0]
    with pytest.raises(NosyncOptionsError, match="nonexistent_name"):
        _run_wrapped(["nonexistent_name"], strict=True)


def test_the_warning_for_a_wrapped_functions_name_says_how_to_declare_it(_clean):
    cached, warned = _run_wrapped(["mask"])
    assert cached == 0 and len(warned) == 1
    assert "functools.wraps wrapper" in warned[0] and "'kwargs.mask'" in warned[0] and "'args.1'" in warned[0]
