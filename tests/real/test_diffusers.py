"""diffusers' own schedulers with the denoiser and ``scheduler.step`` compiled by nosync.

Acceptance of table lifting on the code users run: Euler-family steps read ``self.sigmas`` at the
Python int ``_step_index`` and sync on it every step; with nosync (``codegen="eager"``) no steady
step syncs in the scheduler, the final latents are bitwise equal to eager, and nosync runs no more
graphs per step and compiles no more graphs than stock Dynamo. With Inductor, the latents are
bitwise equal to stock Inductor on the hand-hoisted step.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

pytest.importorskip("diffusers")
import diffusers_pipeline as dp  # noqa: E402  (examples/ is on sys.path: tests/conftest.py)

import torchsync_pass  # noqa: E402
from torchsync_pass import Action, Reason  # noqa: E402

# Slow on a small CPU (Dynamo traces the real modules): `pytest tests` skips them unless
# TORCHSYNC_PASS_REAL=1 (`make test-real` sets it); they skip when diffusers is not installed.
pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(os.environ.get("TORCHSYNC_PASS_REAL") != "1",
                       reason="real-library test: run `make test-real` (or set TORCHSYNC_PASS_REAL=1)"),
]
SCHEDULER_DIR = os.path.join("diffusers", "schedulers")


@pytest.fixture(autouse=True)
def quiet():
    dp.quiet_diffusers()


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b), (a - b).abs().max()


def run(kind, scheduler, denoiser, requests=3, steps=6):
    """Compile the denoiser and scheduler_step with ``kind``; the latents of each request, the
    scheduler's syncs per step of the last one, and the backend's graph counter."""
    torch._dynamo.reset()
    unet = dp.build_unet() if denoiser == "unet" else dp.TinyDenoiser().eval()
    step, counter = dp.scheduler_step, None
    if kind != "eager":
        inner = torchsync_pass.NosyncBackend({"codegen": "eager"}) if kind == "nosync" else "eager"
        counter = dp.Counting(inner)
        unet, step = torch.compile(unet, backend=counter), torch.compile(step, backend=counter)
    sched = dp.make_scheduler(scheduler)
    outs, sched_syncs, runs = [], [], 0
    for r in range(requests):
        runs = counter.runs if counter else 0
        sched_syncs = []
        g = torch.Generator().manual_seed(r)
        latents, text = torch.randn(dp.LATENT, generator=g), torch.randn(dp.TEXT, generator=g)
        noise_gen = torch.Generator().manual_seed(100 + r)  # Euler and EulerAncestral take one
        if "generator" not in inspect.signature(sched.step).parameters:
            noise_gen = None  # UniPC takes none
        sched.set_timesteps(steps)
        latents = latents * sched.init_noise_sigma
        with torch.no_grad():
            for t in sched.timesteps:
                with torchsync_pass.count_syncs() as c:
                    x = sched.scale_model_input(latents, t)
                    noise = unet(x, t, encoder_hidden_states=text)
                    latents = step(sched, getattr(noise, "sample", noise), t, latents, noise_gen)
                sched_syncs.append(sum(n for k, n in c.by_site.items() if SCHEDULER_DIR in k.file))
        outs.append(latents)
    graphs_per_request = (counter.runs - runs) if counter else 0
    return outs, sched_syncs, graphs_per_request, counter.compiled if counter else 0


def check_family(scheduler, denoiser):
    ref, eager_syncs, _, _ = run("eager", scheduler, denoiser)
    assert max(eager_syncs[2:]) > 0  # the scheduler does sync every step eagerly
    _, stock_syncs, stock_graphs, stock_compiles = run("stock", scheduler, denoiser)
    torchsync_pass.reset()
    outs, syncs, graphs, compiles = run("nosync", scheduler, denoiser)
    for a, b in zip(outs, ref):
        assert_bitwise(a, b)
    assert syncs[2:] == [0] * (len(syncs) - 2), syncs  # steady steps: no scheduler sync at all
    assert sum(syncs) <= sum(stock_syncs)
    assert graphs <= stock_graphs and compiles <= stock_compiles
    assert any(d.reason is Reason.TABLE_LIFTED for d in torchsync_pass.decisions())


@pytest.mark.parametrize("denoiser", ["tiny", "unet"])
def test_euler_step_loses_its_table_syncs(denoiser):
    # NOTE: "unet" is a tiny random-weight UNet2DConditionModel: about 9 s on an idle 2-core
    # machine, over 25 minutes under a load average of 8 (three backends trace it).
    check_family("euler", denoiser)


def euler_hoisted(s, noise, t, latents, generator=None):
    """EulerDiscreteScheduler.step (epsilon, s_churn=0) with `s_tmin <= sigma <= s_tmax` answered
    on the host as nosync answers it (True for every index of the default tables)."""
    if s.step_index is None:
        s._init_step_index(t)
    sample = latents.to(torch.float32)
    sigma = s.sigmas[s.step_index]
    gamma = min(0.0 / (len(s.sigmas) - 1), 2**0.5 - 1)
    sigma_hat = sigma * (gamma + 1)
    pred_original_sample = sample - sigma_hat * noise
    derivative = (sample - pred_original_sample) / sigma_hat
    dt = s.sigmas[s.step_index + 1] - sigma_hat
    prev_sample = sample + derivative * dt
    s._step_index += 1
    return prev_sample.to(noise.dtype)


@pytest.mark.inductor
def test_euler_inductor_is_bitwise_equal_to_stock_inductor_on_the_hand_hoisted_step():
    unet = dp.TinyDenoiser().eval()
    results = []
    for step in (torch.compile(euler_hoisted, backend="inductor"),
                 torch.compile(dp.scheduler_step, backend="nosync")):
        torch._dynamo.reset()
        sched = dp.make_scheduler("euler")
        latents, _ = dp.denoise(unet, step, sched, steps=6, seed=0)
        results.append(latents)
    assert_bitwise(results[1], results[0])
    assert any(d.reason is Reason.TABLE_LIFTED for d in torchsync_pass.decisions())


def test_unipc_solve_syncs_are_tabulated():
    """UniPC's corrector solves ``torch.linalg.solve(R, b)`` every step (3 syncs inside the op);
    R and b come from the request's sigmas at the step counter, so nosync tabulates the solve once
    per request (the first step that solves) and every later step syncs nowhere in the scheduler."""
    ref, eager_syncs, _, _ = run("eager", "unipc", "tiny")
    assert eager_syncs[2:] == [3] * (len(eager_syncs) - 2), eager_syncs
    torchsync_pass.reset()
    outs, syncs, _, _ = run("nosync", "unipc", "tiny")
    for a, b in zip(outs, ref):
        assert_bitwise(a, b)
    assert syncs[3:] == [0] * (len(syncs) - 3), syncs  # step 2 tabulates: one solve per index
    ds = [d for d in torchsync_pass.decisions() if d.action is Action.TABULATED]
    assert ds and all(d.reason is Reason.IN_OP_TABULATED for d in ds)
    assert all("scheduling_unipc_multistep.py" in d.site.file and "torch.linalg.solve(R, b)" in d.source for d in ds)


def test_unipc_singular_system_still_raises():
    """sigmas[k] == sigmas[k - 2] makes UniPC's R singular at step k: eager raises LinAlgError
    there, and so does nosync, at the same step with the same message and the same latents before
    it, after a good request compiled and tabulated the solve."""
    unet = dp.TinyDenoiser().eval()
    sched = dp.make_scheduler("unipc")

    def request(step, bad, done):
        sched.set_timesteps(6)
        if bad:
            sched.sigmas[4] = sched.sigmas[2]
        latents, text = torch.ones(dp.LATENT), torch.ones(dp.TEXT)
        with torch.no_grad():
            for t in sched.timesteps:
                latents = step(sched, unet(latents, t, encoder_hidden_states=text), t, latents)
                done.append(latents)

    eager_done, done = [], []
    with pytest.raises(torch.linalg.LinAlgError) as eager_err:
        request(dp.scheduler_step, True, eager_done)
    f = torch.compile(dp.scheduler_step, backend=torchsync_pass.NosyncBackend({"codegen": "eager"}))
    request(f, False, [])
    assert any(d.action is Action.TABULATED for d in torchsync_pass.decisions())
    with pytest.raises(torch.linalg.LinAlgError) as err:
        request(f, True, done)
    assert str(err.value) == str(eager_err.value)
    assert len(done) == len(eager_done) > 0
    for a, b in zip(done, eager_done):
        assert_bitwise(a, b)


def denoise_requests(step, scheduler, steps=8, requests=3):
    """``requests`` requests of the pipeline's loop (TinyDenoiser; ``step`` compiled or not): the
    final latents of each, and the syncs of each step of the last one (all of them, guards too)."""
    unet = dp.TinyDenoiser().eval()
    sched = dp.make_scheduler(scheduler)
    outs, per_step = [], []
    for r in range(requests):
        latents, per_step = dp.denoise(unet, step, sched, steps, seed=r, count=True)
        outs.append(latents)
    return outs, per_step


def test_ddim_step_reads_are_gathered_and_selected():
    """DDIMScheduler.step reads ``alphas_cumprod[timestep]`` (the loop's timestep *tensor*) and
    ``alphas_cumprod[prev_timestep] if prev_timestep >= 0 else final_alpha_cumprod``, in ``step`` and
    again in ``_get_variance``: 6 host reads per step in eager (4 at the last); stock Dynamo specializes on each
    timestep's value (a guard that reads it) and breaks at the computed index. nosync gathers the
    reads on the device and selects the branch with torch.where: no sync in a steady step (the
    third request: the first two speculate that the test is request-invariant, then demote it)."""
    ref, eager_syncs = denoise_requests(dp.scheduler_step, "ddim")
    assert eager_syncs == [6] * 7 + [4], eager_syncs  # the last step's prev_timestep < 0: no read at it
    torch._dynamo.reset()
    torchsync_pass.reset()
    step = torch.compile(dp.scheduler_step, backend=torchsync_pass.NosyncBackend({"codegen": "eager"}))
    outs, syncs = denoise_requests(step, "ddim")
    for a, b in zip(outs, ref):
        assert_bitwise(a, b)
    assert syncs == [0] * len(syncs), syncs
    done = {(d.site.line, d.reason) for d in torchsync_pass.decisions() if d.action is Action.REWRITTEN
            and d.site.file.endswith("scheduling_ddim.py")}
    assert {r for _, r in done} == {Reason.INDEX_TENSOR, Reason.BRANCH_WHERE}, done


def ddim_device_side(s, model_output, timestep, sample, generator=None):
    """DDIMScheduler.step (default config: epsilon, clip_sample, eta=0) written by hand the way
    nosync traces it: each table read an aten.index at the timestep tensor, each
    ``if prev_timestep >= 0`` a torch.where over both arms (the skipped arm's index masked to 0)."""
    index = torch.ops.aten.index.Tensor

    def alphas(t, prev):
        ok = prev >= 0
        return index(s.alphas_cumprod, [t]), torch.where(
            ok, index(s.alphas_cumprod, [torch.where(ok, prev, 0)]), s.final_alpha_cumprod)

    prev_timestep = timestep - s.config.num_train_timesteps // s.num_inference_steps
    alpha_prod_t, alpha_prod_t_prev = alphas(timestep, prev_timestep)
    beta_prod_t = 1 - alpha_prod_t
    pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
    pred_epsilon = model_output
    pred_original_sample = pred_original_sample.clamp(-s.config.clip_sample_range, s.config.clip_sample_range)
    a_t, a_prev = alphas(timestep, prev_timestep)  # _get_variance reads both again
    variance = ((1 - a_prev) / (1 - a_t)) * (1 - a_t / a_prev)
    std_dev_t = 0.0 * variance ** (0.5)
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * pred_epsilon
    return alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction


@pytest.mark.inductor
def test_ddim_inductor_is_bitwise_equal_to_stock_inductor_on_the_device_side_step():
    """The steady request (the third) of nosync with Inductor against stock Inductor on the step
    written the way nosync traces it: the same single graph, so the same bits. (The first two
    requests run graphs specialized on the hoisted test; stock Inductor's fusions of those may
    differ by an ULP, so they are not compared.)"""
    ref, _ = denoise_requests(dp.scheduler_step, "ddim")
    hand, _ = denoise_requests(ddim_device_side, "ddim")
    for a, b in zip(hand, ref):
        assert_bitwise(a, b)  # the reference is DDIM's step, bit for bit, in eager
    want, _ = denoise_requests(torch.compile(ddim_device_side, backend="inductor"), "ddim")
    torch._dynamo.reset()
    torchsync_pass.reset()
    outs, syncs = denoise_requests(torch.compile(dp.scheduler_step, backend="nosync"), "ddim")
    assert syncs == [0] * len(syncs), syncs
    assert_bitwise(outs[2], want[2])
    assert any(d.reason is Reason.BRANCH_WHERE for d in torchsync_pass.decisions())


@pytest.mark.parametrize("dynamic", [None, True], ids=["s_tmax-changes", "dynamic=True"])
def test_euler_churn_with_a_float_dynamo_passes_as_a_tensor(dynamic):
    """Euler's ``if s_tmin <= sigma <= s_tmax`` with ``s_churn > 0``: once Dynamo stops
    specialising ``s_tmax`` (a new value on the second request, or ``dynamic=True``) it reaches the
    graph as a tensor, and nosync's guard read it as one (it raised: "Guard failed on the same frame
    it was created"). Now a float is never a leaf; the latents stay bitwise equal to eager."""
    import diffusers

    def requests(step_of):
        s = diffusers.EulerDiscreteScheduler()
        step = step_of(s)
        outs = []
        for r, kw in enumerate([dict(s_churn=0.5, s_tmax=5.0), dict(s_churn=0.5, s_tmax=2.0)]):
            s.set_timesteps(5)
            lat = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(r)) * s.init_noise_sigma
            g = torch.Generator().manual_seed(100 + r)
            for t in s.timesteps:
                x = s.scale_model_input(lat, t)
                lat = step(torch.tanh(x), t, lat, generator=g, return_dict=False, **kw)[0]
                outs.append(lat)
        return outs

    ref = requests(lambda s: s.step)
    got = requests(lambda s: torch.compile(s.step, backend="nosync", dynamic=dynamic, options={"codegen": "eager"}))
    assert len(got) == len(ref) == 10
    for a, b in zip(got, ref):
        assert_bitwise(a, b)


def test_readme_explain_output_is_what_the_command_prints():
    # the README's abridged explain output went stale (it said 3/5 syncs and 15 in all, the
    # command printed 2/4 and 13): its per-request lines and total are checked against a run
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md")).read()
    cmd = "python -m torchsync_pass.explain examples/diffusers_pipeline.py --denoiser tiny --backend nosync"
    section = readme[readme.index(cmd):]
    section = section[: section.index("## Verification")]
    pattern = r"^(request \d: syncs per step .*|Host syncs: \d+)"
    want = re.findall(pattern, section, re.M)
    out = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # NOTE: the latents' checksum is not compared: Inductor's CPU kernels round differently on
    # another CPU (the README's run was on an Intel Xeon; an AMD EPYC prints other sums), and the
    # sums varied between runs on one machine too
    def strip(line):
        return re.sub(r",\s+latents sum .*", "", re.sub(r"\s+\(CPU-only.*", "", line))

    got = [strip(line) for line in re.findall(pattern, out.stdout, re.M)]
    want = [strip(line) for line in want]
    assert len(want) == 3 and got == want, (got, want)
