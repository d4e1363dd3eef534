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
    assert "functools.wraps wrapper" in warned[0] and "'kwargs.mask'" in warned[0] and "'args.N'" in warned[0]


_ASSERT_SCRIPT = '''
import torch
def f(x, ids):
    torch._assert((ids == 5).sum() == 3, "three fives")
    return x * 2
g = torch.compile(f, backend="nosync", options={"codegen": "eager"})
for _ in range(3):
    g(torch.ones(4), torch.tensor([5, 5, 5, 1]))
'''


def test_explain_does_not_say_no_sync_was_met_beside_a_sync_break(tmp_path, capsys, _clean):
    """torch._assert on a tensor: Dynamo breaks inside the op's fake run ("Data dependent
    operator"), a [sync] break that reaches none of nosync's hooks; explain listed it and then said
    nosync "met no host sync while tracing" (helper 150; torch._check_tensor_all the same before
    torch 2.13)."""
    import json

    from torchsync_pass import explain

    script = tmp_path / "asserting.py"
    script.write_text(_ASSERT_SCRIPT)
    rc = explain.main(["--json", str(script)])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["nosync"] == [] and rep["nosync_graphs"] >= 1
    breaks = sum(cf["sync_graph_breaks"] for cf in rep["compiled"])
    if breaks == 0 and tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 15):
        pytest.skip("this torch traces torch._assert into the graph (a sync inside the op, no break)")
    assert breaks == 1
    text = explain.render_text(rep)
    assert "met no host sync" not in text
    assert "1 graph break(s) tagged [sync] above are syncs Dynamo takes inside an op" in text


def test_explain_says_int_is_not_rewritten_on_this_release(_clean):
    """On torch 2.11 and 2.14+ ``table[int(t)]`` is not rewritten; the decision said the value was
    "used other than as an index" and that the read was "not a direct .item()/int() call in user
    code" (helper 150): it now says the release does not rewrite int() (run by tests/compat.sh)."""
    from torchsync_pass import Action, dynamo_hooks

    if dynamo_hooks.int_reads_rewritable():
        pytest.skip("this torch rewrites table[int(t)] (2.12, 2.13)")
    table = torch.arange(30.0).reshape(10, 3)

    def f(x, t):
        return table[int(t)] * x

    step = torch.compile(f, backend="nosync", options={"codegen": "eager"})
    x = torch.ones(3)
    for i in range(4):
        assert torch.equal(step(x, torch.tensor(i)), f(x, torch.tensor(i)))
    kept = [d for d in torchsync_pass.decisions() if d.action is Action.KEPT]
    assert kept and all("int(t) is not rewritten: index with t.item()" in d.detail for d in kept), kept
    assert all("used other than as an index" not in d.reason.value for d in kept)

    def g(x, t):  # a read through a bound method: not a direct call, and not an int()
        read = t.item
        return table[read()] * x

    torch._dynamo.reset()
    torchsync_pass.reset()
    step = torch.compile(g, backend="nosync", options={"codegen": "eager"})
    for i in range(4):
        assert torch.equal(step(x, torch.tensor(i)), g(x, torch.tensor(i)))
    kept = [d for d in torchsync_pass.decisions() if d.action is Action.KEPT]
    assert kept and all("not a direct" in d.detail and "int(t)" not in d.detail for d in kept), kept


def _checked(x, ids):
    torch._check_tensor_all((ids == 5).sum() == 3, lambda: "need three fives")
    return x * 2


def _checked_with(x, ids):
    torch._check_tensor_all_with(ValueError, (ids == 5).sum() == 3, lambda: "need three fives")
    return x * 2


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - compared with eager's
        return type(e), str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("fn", [_checked, _checked_with])
def test_check_tensor_all_on_an_invariant_tensor_is_hoisted_and_still_raises(fn, _clean):
    """transformers' torch_check (Qwen2-VL's image-token count check): on torch 2.11 and 2.12 the
    call was put in the graph as it is and broke inside the op, out of nosync's reach (helper 150);
    it is now traced as 2.13 traces it. A request that fails the check raises eager's error."""
    torch._dynamo.reset()
    torchsync_pass.reset()
    counters.clear()
    step = torch.compile(fn, backend="nosync", options={"codegen": "eager"})
    x, ids = torch.ones(4), torch.tensor([5, 5, 5, 1])
    assert torch.equal(step(x, ids), fn(x, ids))
    with torchsync_pass.count_syncs() as c:
        out = step(x, ids)
    assert torch.equal(out, fn(x, ids))
    assert c.total == 0 and counters["stats"]["unique_graphs"] == 1
    (d,) = torchsync_pass.decisions()
    assert d.action.name == "HOISTED" and "_check_tensor_all" in d.source
    ids[3] = 5  # written in place: four fives
    expected = _raised(fn, x, ids)
    assert expected is not None and expected[0] is (ValueError if fn is _checked_with else RuntimeError)
    assert _raised(step, x, ids) == expected
    bad = torch.tensor([5, 1, 1, 1])  # a new request that fails the check
    assert _raised(step, x, bad) == _raised(fn, x, bad)
    good = torch.tensor([1, 5, 5, 5])
    assert torch.equal(step(x, good), fn(x, good))


def test_check_tensor_all_with_a_cond_that_is_not_bool_raises_as_stock(_clean):
    """torch 2.11/2.12: the hook traced ``cond._is_all_true()`` on any tensor; an integer cond then
    failed inside the fake run ("INTERNAL ASSERT FAILED") where stock raises torch's TypeError
    (helper 152)."""
    def f(x, ids):
        torch._check_tensor_all_with(ValueError, (ids == 5).sum(), lambda: "need fives")
        return x * 2

    x, ids = torch.ones(4), torch.tensor([5, 5, 5, 1])
    stock = _raised(torch.compile(f, backend="eager"), x, ids)
    torch._dynamo.reset()
    nosync = _raised(torch.compile(f, backend="nosync", options={"codegen": "eager"}), x, ids)
    assert stock is not None and nosync is not None and nosync[0] is stock[0], (nosync, stock)


class _WrappedKw(torch.nn.Module):
    @_rebuilds_args
    def forward(self, x, mask=None, **kwargs):
        return x * (mask.float().cumsum(-1) * 0.5).exp()


def _declare_and_call(invariant: list, by_keyword: bool, model: torch.nn.Module) -> list:
    torch._dynamo.reset()
    torchsync_pass.reset()
    step = torch.compile(model, backend="nosync", options={"codegen": "eager", "invariant": invariant, "strict": True})
    x, mask = torch.ones(4), torch.tensor([1, 0, 1, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = step(x, mask=mask) if by_keyword else step(x, mask)
    assert torch.equal(out, model(x, mask=mask))
    return [str(w.message) for w in caught if "nosync" in str(w.message)]


@pytest.mark.parametrize("model", [_Wrapped(), _WrappedKw()])
def test_a_wrapper_path_to_an_argument_passed_the_other_way_is_not_a_misnamed_declaration(model, _clean):
    """``kwargs.mask`` on a call that passes the mask by position (and ``args.1`` on one that
    passes it by keyword) names nothing on that call, like an argument passed None: it raised
    under strict (helper 154). A name the wrapped function does not take still does."""
    assert _declare_and_call(["kwargs.mask"], False, model) == []
    assert _declare_and_call(["args.1"], True, model) == []
    with pytest.raises(NosyncOptionsError, match="kwargs.maks"):
        _declare_and_call(["kwargs.maks"], True, model)
    with pytest.raises(NosyncOptionsError, match="args.5"):
        _declare_and_call(["args.5"], False, model)


def test_no_hint_for_a_name_that_already_is_the_wrappers_path(_clean):
    """A wrapped forward taking **kwargs: a misnamed 'kwargs.other' got the hint "declare
    'kwargs.kwargs.other'" (helper 154)."""
    with pytest.raises(NosyncOptionsError) as raised:
        _declare_and_call(["kwargs.other"], True, _WrappedKw())
    assert "kwargs.kwargs" not in str(raised.value) and "functools.wraps wrapper" not in str(raised.value)


def test_args_n_past_the_wrapped_functions_last_parameter_is_reported(_clean):
    """``wrapper(self, *args)`` around ``forward(self, x, mask)``: the wrapper's ``*args`` holds
    (x, mask), so 'args.2' names nothing. It was taken for an argument this call did not pass (the
    count included ``self``, which the wrapper takes itself) and went unreported, even under strict."""
    with pytest.raises(NosyncOptionsError, match="args.2"):
        _declare_and_call(["args.2"], True, _Wrapped())
    assert _declare_and_call(["args.1"], True, _Wrapped()) == []  # mask, passed by keyword here
