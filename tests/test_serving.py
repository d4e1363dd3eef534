"""Serving readiness: the supported torch range, counting device moves, diffusers entry points."""

from __future__ import annotations

import configparser
import inspect
import os

import pytest
import torch

import torchsync_pass
from torchsync_pass import dynamo_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# 1. One supported range, one hook table
# --------------------------------------------------------------------------------------------
def test_setup_cfg_pins_the_package_constant():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    (torch_req,) = [r for r in reqs if r.startswith("torch")]
    assert torch_req == torchsync_pass.TORCH_REQUIREMENT == "torch>=2.11,<2.16"
    assert dynamo_hooks.SUPPORTED_TORCH == ((2, 11), (2, 16))


def test_hook_table_has_a_row_per_supported_release():
    lo, hi = dynamo_hooks.SUPPORTED_TORCH
    assert sorted(dynamo_hooks.HOOK_TABLE) == [(lo[0], m) for m in range(lo[1], hi[1])]
    # 2.11 has no hook point for operator.index (nor bool/int/float: they reach .item())
    assert dynamo_hooks.hook_row((2, 11, 0))["index"] is None
    assert dynamo_hooks.hook_row((2, 12, 1))["index"] == "nb_index_impl"
    assert dynamo_hooks.hook_row((2, 15, 0))["bool"] == "nb_bool_impl"
    assert dynamo_hooks.hook_row((2, 10))["index"] is None  # experiments: the nearest row
    assert dynamo_hooks.hook_row((2, 17))["bool"] == "nb_bool_impl"


def test_running_torch_has_every_hook_of_its_row():
    from torch._dynamo.variables.tensor import TensorVariable

    row = dynamo_hooks.hook_row()
    for kind in row:
        attr = dynamo_hooks._method_attr(kind)
        assert attr == row[kind]
        assert attr is None or hasattr(TensorVariable, attr)


# --------------------------------------------------------------------------------------------
# 2. count_syncs(): a device move counts only when it would be a device-to-host read on a GPU
# --------------------------------------------------------------------------------------------
def moves(x, other):
    a = x[None].to(other.device)  # MOVE same-device
    b = x.to(other)  # MOVE same-device
    c = x.to(device=other.device)  # MOVE same-device
    d = x.to("cpu")  # MOVE host
    e = x.cpu()  # MOVE host
    f = x.to(torch.device("cpu"))  # MOVE host
    g = x.to(device="cpu", dtype=torch.float64)  # MOVE host
    return a.sum() + b + c + d + e + f + g


def same_device_moves(x, other):
    t = x[None].to(other.device)
    return t.to(other) * 2 + x.to(device=other.device)


def _lines(fn, marker):
    src, first = inspect.getsourcelines(fn)
    return {first + i for i, t in enumerate(src) if t.rstrip().endswith(marker)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
def test_count_syncs_counts_only_moves_that_name_the_host():
    x, other = torch.tensor(3.0), torch.randn(2)
    with torchsync_pass.count_syncs(profiler=False) as c:
        moves(x, other)
    host, same = _lines(moves, "# MOVE host"), _lines(moves, "# MOVE same-device")
    assert len(host) == 4 and len(same) == 3
    counted = {k.line for k in c.by_site if k.file == __file__}
    assert counted == host
    assert c.by_kind == {"cpu": 4} and c.total == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
@pytest.mark.parametrize("how", ["eager", "stock-eager-backend", "nosync-eager"])
def test_same_device_moves_count_zero_whatever_the_codegen(how):
    torch._dynamo.reset()
    fn = {
        "eager": same_device_moves,
        "stock-eager-backend": torch.compile(same_device_moves, backend="eager"),
        "nosync-eager": torch.compile(same_device_moves, backend="nosync", options={"codegen": "eager"}),
    }[how]
    x, other = torch.tensor(3.0), torch.randn(2)
    fn(x, other)  # compile outside the counter
    with torchsync_pass.count_syncs() as c:
        out = fn(x, other)
    assert torch.equal(out, same_device_moves(x, other))
    assert c.total == 0, c.summary()


def _unet_line(needle: str) -> tuple[str, int]:
    from diffusers.models.unets import unet_2d_condition

    path = inspect.getsourcefile(unet_2d_condition)
    with open(path) as f:
        (line,) = [i for i, t in enumerate(f, 1) if needle in t]
    return path, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rule")
def test_diffusers_unet_timestep_move_is_not_a_sync():
    pytest.importorskip("diffusers")
    from real_pipelines import CROSS_DIM, tiny_unet

    path, line = _unet_line("timesteps = timesteps[None].to(sample.device)")
    torch.manual_seed(0)
    unet = tiny_unet()
    sample, emb = torch.randn(2, 4, 8, 8), torch.randn(2, 7, CROSS_DIM)
    with torch.no_grad(), torchsync_pass.count_syncs() as c:
        for t in (torch.tensor(981), torch.tensor(961)):  # 0-d timesteps: the .to() line runs
            unet(sample, t, encoder_hidden_states=emb)
    assert torchsync_pass.SiteKey(path, line) not in c.by_site
    assert "cpu" not in c.by_kind
    assert c.total == 0, c.summary()
