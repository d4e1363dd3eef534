"""Bitwise verification: compare_outputs, verify_compiled (per graph), verify_loop (per loop).

Cheap backends only (eager, aot_eager and hand-written callables), except one test marked
``inductor``. The conftest fixture resets Dynamo and the nosync state around every test.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import math
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import FakeTensorMode

import torchsync_pass
from torchsync_pass.errors import VerificationError
from torchsync_pass.loop import LoopMode, LoopReport, resolve_modes, verify_loop
from torchsync_pass.verify import (
    Diff,
    Mismatch,
    VerificationSkippedWarning,
    VerificationWarning,
    VerifyStatus,
    compare_outputs,
    format_mismatches,
    max_ulp_distance,
    reference_graph,
    snapshot,
    verify_compiled,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def one_ulp_up(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A copy of ``t`` whose flat element ``index`` is moved by one ULP (its bit pattern + 1)."""
    ints = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    out = t.detach().clone()
    out.view(ints[t.dtype]).view(-1)[index] += 1
    return out


def only(mismatches: list[Mismatch]) -> Mismatch:
    assert len(mismatches) == 1, format_mismatches(mismatches)
    return mismatches[0]


def line_of(fn, text: str) -> int:
    """The file line number of the first source line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if text in line:
            return start + offset
    raise AssertionError(f"{text!r} not in {fn.__name__}")


@contextlib.contextmanager
def record_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: float


Point = collections.namedtuple("Point", ["x", "y"])


# --------------------------------------------------------------------------------------------
# compare_outputs
# --------------------------------------------------------------------------------------------


def test_equal_tensors_and_nans_with_the_same_bits_are_equal():
    x = torch.tensor([1.0, float("nan"), -2.5, float("inf")])
    assert compare_outputs(x, x.clone()) == []
    # A NaN with another payload or sign in the same place differs: the comparison is of bits
    # (review 16: it counted as equal, and verify_loop called a NaN whose sign the compile lost
    # "bitwise equal").
    for bits in (0x7FC00001, -0x400000):  # another payload; the sign bit (0xFFC00000)
        other_nan = x.clone()
        other_nan.view(torch.int32)[1] = bits
        assert torch.isnan(other_nan[1])
        m = only(compare_outputs(x, other_nan))
        assert m.diffs == (Diff.VALUE,) and m.num_different == 1 and m.index == (1,)
        assert math.isnan(m.max_abs) and "NaN on both sides with another sign or payload" in m.detail
        assert f"0x{bits & 0xFFFFFFFF:08x}" in m.detail
    # a number that differs too is what max_abs reports
    other = x.clone()
    other.view(torch.int32)[1] = 0x7FC00001
    other[0] = 1.5
    m = only(compare_outputs(x, other))
    assert m.num_different == 2 and m.max_abs == 0.5 and m.index == (0,)
    # Python floats: the same rule
    assert compare_outputs(float("nan"), float("nan")) == []
    assert "another sign or payload" in only(compare_outputs(float("nan"), -float("nan"))).detail


def test_negative_zero_differs_from_zero():
    m = only(compare_outputs(torch.tensor([1.0, -0.0]), torch.tensor([1.0, 0.0])))
    assert m.path == "out"
    assert m.diffs == (Diff.VALUE,)
    assert m.num_different == 1 and m.numel == 2
    assert m.max_abs == 0.0 and m.max_ulp == 0
    assert m.index == (1,)
    assert math.copysign(1.0, m.expected_value) == -1.0 and math.copysign(1.0, m.actual_value) == 1.0


def test_nan_on_one_side_only():
    m = only(compare_outputs(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])))
    assert m.diffs == (Diff.VALUE,)
    assert "1 NaN on one side only" in m.detail
    assert math.isnan(m.max_abs) and m.max_ulp is None
    assert m.index == (1,)


def test_one_ulp_difference_reported_with_abs_and_ulp():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m = only(compare_outputs(x, one_ulp_up(x, 3)))
    assert m.max_ulp == 1
    assert m.max_abs == pytest.approx(2.0**-21)  # one ULP at 4.0 in float32
    assert m.index == (1, 1) and m.expected_value == 4.0
    assert m.num_different == 1


@pytest.mark.parametrize(
    "expected, actual, diffs, detail",
    [
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), (Diff.DTYPE,), "dtype torch.float32 vs torch.float64"),
        (torch.zeros(2, 3), torch.zeros(3, 2), (Diff.SHAPE,), "shape [2, 3] vs [3, 2]"),
        (torch.zeros(2, 3), torch.zeros(3, 2).t(), (Diff.STRIDE,), "stride (3, 1) vs (1, 2)"),
        (torch.zeros(2, 3), torch.zeros(2, 3, device="meta"), (Diff.DEVICE,), "device cpu vs meta"),
        (torch.zeros(2), [0.0, 0.0], (Diff.TYPE,), "type Tensor vs list"),
    ],
)
def test_metadata_differences(expected, actual, diffs, detail):
    m = only(compare_outputs(expected, actual))
    assert m.diffs == diffs
    assert detail in m.detail


def test_dtype_difference_still_reports_values():
    m = only(compare_outputs(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5], dtype=torch.float64)))
    assert m.diffs == (Diff.DTYPE, Diff.VALUE)
    assert m.max_abs == 0.5


def test_stride_of_size_one_dimension_is_not_significant():
    x = torch.arange(3.0).reshape(3, 1)
    y = torch.as_strided(x.clone(), (3, 1), (1, 7))
    assert x.stride() != y.stride()
    assert compare_outputs(x, y) == []
    # A column-major copy with the same values is a stride difference, and only that.
    m = only(compare_outputs(torch.ones(2, 2), torch.ones(2, 2).t().contiguous().t()))
    assert m.diffs == (Diff.STRIDE,) and m.detail == "stride (2, 1) vs (1, 2)"


def test_nested_structures_name_the_path():
    e = (torch.zeros(2), {"h": torch.ones(3), "n": 3}, Pair(torch.zeros(1), 1.5), Point(1, 2.0), [1, 2])
    a = (torch.zeros(2), {"h": one_ulp_up(torch.ones(3), 2), "n": 4}, Pair(torch.zeros(1), 1.25), Point(1, 2.0), [1, 2, 3])
    by_path = {m.path: m for m in compare_outputs(e, a)}
    assert set(by_path) == {"out[1]['h']", "out[1]['n']", "out[2].b", "out[4]"}
    assert by_path["out[1]['h']"].max_ulp == 1 and by_path["out[1]['h']"].index == (2,)
    assert by_path["out[1]['n']"].detail == "3 vs 4"
    assert by_path["out[2].b"].max_abs == 0.25 and by_path["out[2].b"].max_ulp == 2**50
    assert by_path["out[4]"].diffs == (Diff.STRUCTURE,) and by_path["out[4]"].detail == "length 2 vs 3"
    # named tuples use field names
    assert only(compare_outputs(Point(1, 2.0), Point(1, -2.0))).path == "out.y"


def test_any_pytree_container_is_walked():
    x = torch.tensor([1.0, 2.0])
    m = only(compare_outputs(collections.deque([x]), collections.deque([one_ulp_up(x, 1)])))
    assert m.path == "out[0]" and m.max_ulp == 1 and m.index == (1,)


def test_snapshot_copies_tensors_in_dataclasses_and_pytree_containers():
    t = torch.ones(2)
    snap = snapshot({"p": Pair(t, 1.0), "q": collections.deque([t, t[1:]])})
    t.add_(1)
    assert snap["p"].a.tolist() == [1.0, 1.0] and snap["q"][0].tolist() == [1.0, 1.0]
    assert snap["p"].b == 1.0 and isinstance(snap["q"], collections.deque)
    storage = snap["p"].a.untyped_storage().data_ptr()
    assert storage == snap["q"][1].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # aliasing kept
    assert snap["q"][1].storage_offset() == 1


def test_container_and_scalar_type_differences():
    by_path = {m.path: m for m in compare_outputs({"a": (1, 2), "b": True}, {"a": [1, 2], "c": 1}, root="r")}
    assert by_path["r['a']"].diffs == (Diff.TYPE,) and by_path["r['a']"].detail == "type tuple vs list"
    assert by_path["r"].diffs == (Diff.STRUCTURE,)
    assert by_path["r"].detail == "keys missing ['b'], unexpected ['c']"
    assert only(compare_outputs(True, 1)).detail == "type bool vs int"
    assert only(compare_outputs(-0.0, 0.0)).max_ulp == 0
    assert compare_outputs(float("nan"), float("nan")) == []
    assert compare_outputs(None, None) == [] and compare_outputs("x", "x") == []


def test_integer_and_bool_tensors():
    m = only(compare_outputs(torch.tensor([1, 5, 3]), torch.tensor([1, 2, 3])))
    assert m.max_abs == 3.0 and m.max_ulp is None and m.index == (1,)
    m = only(compare_outputs(torch.tensor([True, False]), torch.tensor([True, True])))
    assert m.num_different == 1 and m.max_abs == 1.0


def test_complex_tensors_compare_per_component():
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    y = x.clone()
    torch.view_as_real(y)[1, 1] = one_ulp_up(torch.view_as_real(y)[1, 1].reshape(1))[0]
    m = only(compare_outputs(x, y))
    assert m.max_ulp == 1 and m.index == (1,) and m.num_different == 1


_F64_MAX = torch.finfo(torch.float64).max
_TINY32 = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # smallest subnormal


@pytest.mark.parametrize(
    "dtype, a, b, ulps",
    [
        (torch.float32, 1.0, 2.0, 2**23),
        (torch.float32, 1.0, 1.0 + 2.0**-23, 1),
        (torch.float32, _TINY32, -_TINY32, 2),
        (torch.float32, -0.0, 0.0, 0),
        (torch.float32, torch.finfo(torch.float32).max, float("inf"), 1),
        (torch.float16, 1.0, 1.0 + 2.0**-10, 1),
        (torch.float16, 1.0, 2.0, 2**10),
        (torch.bfloat16, 1.0, 1.0078125, 1),
        (torch.bfloat16, -1.0, 1.0, 2 * 0x3F80),
        (torch.float64, 1.0, 2.0, 2**52),
        (torch.float64, 1.0, -1.0, 2 * 0x3FF0000000000000),
        # Crosses zero over the whole range: 2**64 - 2**53 - 2 does not fit in int64; must be exact.
        (torch.float64, _F64_MAX, -_F64_MAX, 2 * 0x7FEFFFFFFFFFFFFF),
    ],
)
def test_ulp_distance_known_values(dtype, a, b, ulps):
    ta, tb = torch.tensor([a], dtype=dtype), torch.tensor([b], dtype=dtype)
    assert max_ulp_distance(ta, tb) == ulps
    assert max_ulp_distance(tb, ta) == ulps


def test_ulp_distance_undefined_cases():
    assert max_ulp_distance(torch.tensor([float("nan")]), torch.tensor([1.0])) is None
    assert max_ulp_distance(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0])) == 0
    assert max_ulp_distance(torch.tensor([1, 2]), torch.tensor([1, 3])) is None
    with pytest.raises(ValueError, match="same dtype and shape"):
        max_ulp_distance(torch.zeros(2), torch.zeros(3))


def test_format_mismatches_is_readable_and_limited():
    x = torch.ones(4)
    ms = [dataclasses.replace(only(compare_outputs(x, one_ulp_up(x))), path=f"out[{i}]") for i in range(12)]
    text = format_mismatches(ms, limit=2)
    assert text.splitlines()[0] == (
        "out[0]: values differ in 1 of 4 elements; max abs diff 1.19209e-07; max ULP distance 1; "
        "at index [0]: expected 1.0, got 1.0000001192092896"
    )
    assert text.splitlines()[-1] == "... and 10 more"
    assert format_mismatches([]) == "(bitwise equal)"
    assert json.loads(json.dumps(ms[0].to_json()))["max_ulp"] == 1


# --------------------------------------------------------------------------------------------
# verify_compiled
# --------------------------------------------------------------------------------------------


def graph_step(x, y):
    a = x * 2
    b = a.sin() + y
    return a, b


def capture(fn, *args, **compile_kwargs):
    """Run ``fn`` under torch.compile with a backend that records (gm, example_inputs)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=backend, **compile_kwargs)(*args)
    assert len(seen) == 1
    return seen[0]


def perturb_output(gm, index):
    def run(*args):
        outs = list(gm(*args))
        outs[index] = one_ulp_up(outs[index])
        return tuple(outs)

    return run


def test_wrong_compiled_fn_gives_one_warning_naming_output_and_user_line():
    results = []

    def wrong_backend(gm, example_inputs):
        results.append(verify_compiled(gm, perturb_output(gm, 1), example_inputs, strict=False, name="step_graph"))
        return gm.forward

    with record_warnings() as caught:
        torch.compile(graph_step, backend=wrong_backend)(torch.randn(8), torch.randn(8))
    ours = [w for w in caught if issubclass(w.category, VerificationWarning)]
    assert len(ours) == 1
    assert ours[0].category is VerificationWarning
    text = str(ours[0].message)
    line = line_of(graph_step, "b = a.sin() + y")
    assert text.startswith("nosync verify: graph 'step_graph': compiled graph is not bitwise equal to eager (1 of 2 outputs differ)")
    assert "out[1]: values differ in 1 of 8 elements" in text and "max ULP distance 1" in text
    assert f"{__file__}:{line} in graph_step: b = a.sin() + y" in text
    assert "out[0]" not in text
    (result,) = results
    assert result.status is VerifyStatus.FAILED and not result.ok
    assert result.inputs_from == "example_inputs"
    m = only(result)
    assert m.path == "out[1]" and m.max_ulp == 1 and m.max_abs > 0
    assert m.source == f"produced by {__file__}:{line} in graph_step: b = a.sin() + y"
    assert result.message == text


def test_strict_raises_verification_error_with_the_same_text():
    x, y = torch.randn(8), torch.randn(8)
    gm, example_inputs = capture(graph_step, x, y)
    with record_warnings() as caught:
        lenient = verify_compiled(gm, perturb_output(gm, 1), example_inputs, strict=False, name="g")
    with pytest.raises(VerificationError) as info:
        verify_compiled(gm, perturb_output(gm, 1), example_inputs, strict=True, name="g")
    assert isinstance(info.value, torchsync_pass.VerificationError)
    strict_text = str(info.value)
    # Same report; only the closing hint differs (it names the option to change).
    assert strict_text.splitlines()[:-1] == lenient.message.splitlines()[:-1]
    assert "set options={'verify': False}" in strict_text.splitlines()[-1]


def test_strict_error_inside_a_backend_reaches_the_user_through_dynamo():
    def strict_backend(gm, example_inputs):
        verify_compiled(gm, perturb_output(gm, 0), example_inputs, strict=True, name="g")
        return gm.forward

    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(graph_step, backend=strict_backend)(torch.randn(4), torch.randn(4))
    assert isinstance(info.value.inner_exception, VerificationError)
    assert "out[0]: values differ" in str(info.value)


def test_correct_compiled_fn_passes_without_warning():
    x, y = torch.randn(8), torch.randn(8)
    gm, example_inputs = capture(graph_step, x, y)
    with record_warnings() as caught:
        result = verify_compiled(gm, gm.forward, example_inputs, strict=True, name="g")
    assert result.status is VerifyStatus.PASSED and result.ok and list(result) == []
    assert [w for w in caught if issubclass(w.category, VerificationWarning)] == []


def test_dynamo_passes_real_example_inputs_and_symint_hints_are_used():
    gm, example_inputs = capture(graph_step, torch.randn(5), torch.randn(5), dynamic=True)
    assert any(isinstance(v, torch.SymInt) for v in example_inputs)  # the size is symbolic
    tensors = [v for v in example_inputs if isinstance(v, torch.Tensor)]
    from torch._subclasses.fake_tensor import is_fake

    assert tensors and not any(is_fake(t) for t in tensors)  # torch 2.13: real tensors
    result = verify_compiled(gm, gm.forward, example_inputs, strict=True, name="dyn")
    assert result.status is VerifyStatus.PASSED and result.inputs_from == "example_inputs"


def test_fake_example_inputs_fall_back_to_dynamo_grapharg_values():
    """Driven with FakeTensors, the backend still verifies on the real values Dynamo traced with."""
    results = []

    def fake_fed(gm, example_inputs):
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in example_inputs]
        results.append(verify_compiled(gm, perturb_output(gm, 1), fakes, strict=False, name="g"))
        return gm.forward

    with record_warnings() as caught:
        torch.compile(graph_step, backend=fake_fed)(torch.randn(6), torch.randn(6))
    (result,) = results
    assert result.inputs_from == "grapharg"
    assert result.status is VerifyStatus.FAILED and only(result).path == "out[1]"
    assert [w.category for w in caught if issubclass(w.category, VerificationWarning)] == [VerificationWarning]


def test_fake_inputs_without_real_values_are_skipped_and_say_so():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    fake = FakeTensorMode().from_tensor(torch.randn(3))
    with pytest.warns(VerificationSkippedWarning) as caught:
        result = verify_compiled(gm, gm.forward, [fake], strict=False, name="g")
    assert len(caught) == 1
    assert result.status is VerifyStatus.SKIPPED and result.skipped and not result.ok
    assert result.reason == "example input 0 is a FakeTensor, and placeholder 'x' carries no real value (no grapharg)"
    assert str(caught[0].message) == (
        "nosync verify: graph 'g': verification skipped: " + result.reason
        + "; the compiled graph was NOT checked against eager"
    )
    with pytest.raises(VerificationError, match="verification skipped: example input 0 is a FakeTensor"):
        verify_compiled(gm, gm.forward, [fake], strict=True, name="g")


def mutating_step(x, y):
    y.add_(1)  # in-place write to an input
    return x * y


def test_missed_input_mutation_is_reported_and_real_inputs_untouched():
    x, y = torch.randn(4), torch.randn(4)
    checked = {}

    def forgetful(gm, example_inputs):
        live = [t.clone() for t in example_inputs]

        def run(*args):  # computes the output but does not write y back
            args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            return gm(*args)

        with record_warnings() as caught:
            checked["result"] = verify_compiled(gm, run, example_inputs, strict=False, name="g")
        checked["untouched"] = all(torch.equal(a, b) for a, b in zip(live, example_inputs))
        return gm.forward

    torch.compile(mutating_step, backend=forgetful)(x, y)
    assert checked["untouched"]  # verification ran on clones
    m = only(checked["result"])
    assert m.path.startswith("input[") and m.num_different == 4
    line = line_of(mutating_step, "y.add_(1)")
    assert f"{__file__}:{line} in mutating_step: y.add_(1)" in m.source
    assert "written in place by" in m.source


def test_clones_keep_strides_offsets_and_aliasing():
    base = torch.arange(12.0)
    a, b = base[2:].view(5, 2).t(), base[4:8]
    gm = torch.fx.symbolic_trace(lambda a, b: (a * 1, b * 1))
    seen = []

    def probe(a_, b_):
        seen.append((a_.stride(), a_.storage_offset(), b_.storage_offset(),
                     a_.untyped_storage().data_ptr() == b_.untyped_storage().data_ptr(),
                     a_.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()))
        return gm(a_, b_)

    assert verify_compiled(gm, probe, [a, b], strict=True, name="g").ok
    assert seen == [(a.stride(), 2, 4, True, True)]


def test_random_ops_replay_the_same_stream_and_restore_rng():
    gm = torch.fx.symbolic_trace(lambda x: x + torch.rand(3))
    before = torch.get_rng_state()
    assert verify_compiled(gm, gm.forward, [torch.zeros(3)], strict=True, name="g").ok
    assert torch.equal(torch.get_rng_state(), before)


def test_compiled_fn_that_raises_or_drops_outputs():
    gm, example_inputs = capture(graph_step, torch.randn(3), torch.randn(3))

    def boom(*args):
        raise RuntimeError("kernel exploded")

    with record_warnings() as caught:
        raised = verify_compiled(gm, boom, example_inputs, strict=False, name="g")
        short = verify_compiled(gm, lambda *a: gm(*a)[:1], example_inputs, strict=False, name="g")
    assert only(raised).diffs == (Diff.ERROR,)
    assert only(raised).detail == "the compiled graph raised RuntimeError: kernel exploded"
    assert raised.message.splitlines()[0] == (
        "nosync verify: graph 'g': the compiled graph raised on inputs the eager FX graph accepts"
    )
    assert only(short).diffs == (Diff.STRUCTURE,) and only(short).detail == "2 outputs vs 1"


def test_reference_graph_is_an_independent_copy():
    gm, _ = capture(graph_step, torch.randn(3), torch.randn(3))
    ref = reference_graph(gm)
    for node in list(gm.graph.nodes):  # rewrite the original in place, as a compiler may
        if node.op == "call_method" and node.target == "sin":
            node.target = "cos"
    gm.recompile()
    assert any(n.target == "sin" for n in ref.graph.nodes)
    assert [n.meta.get("stack_trace") for n in ref.graph.nodes] != [None] * len(ref.graph.nodes)


# --------------------------------------------------------------------------------------------
# verify_loop
# --------------------------------------------------------------------------------------------


class Stepper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, t):
        self.calls.add_(1)
        h = torch.tanh(self.lin(x) + t)
        return {"h": h, "t": t * 2}


def denoise_calls(i, state, prev):
    """Producer: carry x through the loop like a denoiser, for 6 steps."""
    if i == 6:
        return None
    if prev is not None:
        state["x"] = state["x"] - 0.1 * prev["h"]
    return (state["x"], torch.tensor(1.0 - i / 6)), {}


def make_state():
    return {"x": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))}


def wrong_from_call(k):
    """A backend whose compiled graph moves output 0 by one ULP from its k-th call on."""

    def backend(gm, example_inputs):
        count = [0]

        def run(*args):
            outs = list(gm(*args))
            if count[0] >= k:
                outs[0] = one_ulp_up(outs[0])
            count[0] += 1
            return tuple(outs)

        return run

    backend.__name__ = f"wrong_from_call_{k}"
    return backend


def test_verify_loop_reports_ok_on_correct_backends():
    torch.manual_seed(0)
    model = Stepper()
    with torch.no_grad():
        report = verify_loop(
            model, denoise_calls, setup=make_state,
            modes=("aot_eager", LoopMode("passthrough", lambda gm, ex: gm.forward)),
        )
    assert isinstance(report, LoopReport) and report.ok
    assert report.steps == 6
    for mode in report.modes:
        assert mode.ok and mode.steps_run == 6 and mode.first_divergence is None
        assert mode.graphs == 1
    assert "bitwise equal to eager on every step" in str(report)
    assert float(model.calls) == 0.0  # every run used its own deep copy


def test_verify_loop_finds_the_first_diverging_step():
    torch.manual_seed(0)
    with torch.no_grad():
        report = verify_loop(
            Stepper(), denoise_calls, setup=make_state,
            modes=(LoopMode("good", "aot_eager"), LoopMode("wrong", wrong_from_call(3))),
        )
    assert not report.ok
    assert report["good"].ok
    wrong = report["wrong"]
    first = wrong.first_divergence
    assert first.step == 3 and first.reference == "eager" and first.phase == "step"
    assert first.mismatch.path == "out['h']" and first.mismatch.max_ulp == 1
    assert wrong.diverging_steps == 3  # steps 3, 4, 5 (the error carries through x)
    assert wrong.steps_run == 6
    text = str(report)
    assert "wrong" in text and "FAILED" in text
    assert "first divergence from eager: step 3, vs eager: out['h']: values differ in 1 of 12 elements" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False
    assert data["modes"][1]["first_divergence"]["step"] == 3
    assert data["modes"][1]["first_divergence"]["mismatch"]["path"] == "out['h']"


def test_verify_loop_list_of_calls_and_mode_references():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    calls = [((x, torch.tensor(float(i))), {}) for i in range(4)]
    report = verify_loop(
        Stepper(), calls,
        modes=(LoopMode("ref", wrong_from_call(0), must_equal=None),
               LoopMode("same-as-ref", wrong_from_call(0), must_equal="ref"),
               LoopMode("later", wrong_from_call(2), must_equal="ref")),
    )
    assert report["ref"].ok  # differs from eager, but only reported
    assert report["ref"].eager_first_step == 0 and report["ref"].eager_max_ulp == 1
    assert report["same-as-ref"].ok
    later = report["later"]
    assert not later.ok and later.first_divergence.step == 0 and later.first_divergence.reference == "ref"
    assert "vs eager: max abs diff" in str(report)


@pytest.mark.parametrize("reference", ["eager", "dynamo-eager"])
def test_verify_loop_compares_final_module_state(reference):
    # also for a mode checked against another mode (nosync-inductor is checked against inductor)
    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(2))

        def forward(self, x):
            self.acc.add_(x)
            return x * 2

    def forgets_buffer_writes(gm, example_inputs):
        def run(*args):
            return gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])

        return run

    calls = [((torch.ones(2),), {}) for _ in range(3)]
    modes = (LoopMode("forgetful", forgets_buffer_writes, must_equal=reference),)
    if reference != "eager":
        modes = (reference, *modes)
    report = verify_loop(Leaky(), calls, modes=modes)
    mode = report["forgetful"]
    assert not mode.ok and not report.ok
    final = [m for m in mode.mismatches if m.phase == "final"]
    assert [m.mismatch.path for m in final] == ["final['module']['acc']"]
    assert {m.reference for m in final} == {reference}
    assert all(m.phase == "final" for m in mode.mismatches)  # per-step outputs were equal


def test_verify_loop_replays_rng_and_restores_it():
    def noisy(x):
        return x + torch.rand_like(x)

    before = torch.get_rng_state()
    report = verify_loop(noisy, [((torch.zeros(3),), {})] * 3, modes=("aot_eager",))
    assert report.ok
    assert torch.equal(torch.get_rng_state(), before)


def test_verify_loop_records_a_failing_mode():
    def broken(gm, example_inputs):
        def run(*args):
            raise RuntimeError("no kernel")

        return run

    report = verify_loop(lambda x: x + 1, [((torch.zeros(2),), {})] * 2, modes=(LoopMode("broken", broken),))
    mode = report["broken"]
    assert not mode.ok and mode.steps_run == 0
    assert mode.error == "RuntimeError at step 0: no kernel"
    assert "error: RuntimeError at step 0: no kernel" in str(report)


def test_verify_loop_rejects_bad_calls_and_modes():
    with pytest.raises(TypeError, match=r"call 0 must be an \(args, kwargs\) pair"):
        verify_loop(lambda x: x, [torch.zeros(1)], modes=())
    with pytest.raises(ValueError, match="unknown mode 'nosync'"):
        verify_loop(lambda x: x, [], modes=("nosync",))
    with pytest.raises(ValueError, match="'eager' is the reference"):
        verify_loop(lambda x: x, [], modes=("eager",))


def test_default_modes_compile_the_documented_way():
    modes = {m.name: m for m in resolve_modes(("nosync-eager", "nosync-inductor"), options={"invariant": ["tt"]})}
    assert set(modes) == {"nosync-eager", "nosync-inductor", "inductor"}  # the reference is added
    assert modes["nosync-eager"].backend == "nosync"
    assert dict(modes["nosync-eager"].options) == {"codegen": "eager", "invariant": ["tt"]}
    assert modes["nosync-eager"].must_equal == "eager"
    assert dict(modes["nosync-inductor"].options) == {"codegen": "inductor", "invariant": ["tt"]}
    assert modes["nosync-inductor"].must_equal == "inductor"
    assert modes["inductor"].backend == "inductor" and modes["inductor"].must_equal is None
    hoisted = resolve_modes(("nosync-inductor", "inductor"), hoisted=lambda x: x)
    assert {m.name: m.must_equal for m in hoisted}["nosync-inductor"] == "inductor-hoisted"


def test_nosync_eager_loop_is_bitwise_equal_to_eager():
    """The real nosync backend with codegen="eager": a sync on a request-invariant input."""

    def step(x, scale):
        if scale.item() > 1.0:  # request-invariant sync
            x = x * scale
        return torch.tanh(x)

    scale = torch.tensor(2.0)

    def calls(i, state, prev):
        if i == 5:
            return None
        return (state["x"] if prev is None else prev, scale), {}

    report = verify_loop(step, calls, setup=lambda: {"x": torch.randn(3)}, modes=("nosync-eager",))
    assert report.ok, str(report)
    assert report["nosync-eager"].steps_run == 5


@pytest.mark.inductor
def test_inductor_codegen_checked_against_reference_graph():
    """One Inductor compile: keep the FX reference before compile_fx rewrites gm in place."""
    from torch._inductor.compile_fx import compile_fx

    results = []

    def backend(gm, example_inputs):
        ref = reference_graph(gm)
        compiled = compile_fx(gm, example_inputs)
        results.append(verify_compiled(ref, compiled, example_inputs, strict=False, name="inductor"))
        return compiled

    def f(x):
        return x * 2 + 1, x.neg()

    torch.compile(f, backend=backend)(torch.randn(16))
    (result,) = results
    assert result.status is VerifyStatus.PASSED, result.message


def test_verify_loop_allows_one_level_of_references():
    ok = resolve_modes((LoopMode("ref", "eager", must_equal=None), LoopMode("b", "eager", must_equal="ref")))
    assert [m.name for m in ok] == ["ref", "b"]
    chain = (LoopMode("a", "eager", must_equal="b"), LoopMode("b", "eager", must_equal="c"),
             LoopMode("c", "eager", must_equal=None))
    with pytest.raises(ValueError, match="mode 'a' must equal 'b', which itself must equal 'c'"):
        verify_loop(lambda x: x, [], modes=chain)
    with pytest.raises(ValueError, match="mode 'a' must equal 'a', which itself must equal 'a'"):
        verify_loop(lambda x: x, [], modes=(LoopMode("a", "eager", must_equal="a"),))

