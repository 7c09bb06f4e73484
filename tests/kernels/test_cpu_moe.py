"""cpu_moe, the bundled CPU MoE (the compiled AMX kernel of moe_eval/kernels/csrc/cpu_moe.cpp): against the
fp32 oracle and torch_moe (whose numerics it keeps), repeatable bit for bit, batch-invariant, and torch_moe
where it cannot run.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from moe_eval.kernels import cpu_moe as cpu_moe_module
from moe_eval.kernels.cpu_moe import cpu_moe, fits, implementation
from moe_eval.kernels.testing import make_case, rel_err
from moe_eval.kernels.torch_moe import torch_moe

HAS_AMX = torch.cpu._is_amx_tile_supported()


@pytest.fixture
def compiled_only(monkeypatch):
    """A torch_moe fallback inside cpu_moe fails the test: the kernel's tests would all pass on it."""

    def refused(*args, **kwargs):
        raise AssertionError("cpu_moe fell back to torch_moe")

    monkeypatch.setattr(cpu_moe_module, "torch_moe", refused)


def needs_kernel(test):
    """The compiled kernel's own tests: AMX CPUs only, and no fallback allowed."""
    skip = pytest.mark.skipif(not HAS_AMX, reason="the compiled kernel runs on AMX CPUs only")
    return skip(pytest.mark.usefixtures("compiled_only")(test))


# (T, E, K, D, F): the embedded default's canary (E 8, D 256, F 128) and at TP2 (F 64), the tiny random
# Qwen3-MoE (D 128, F 64) and at TP2 (F 32), a wider one, K = 4, and the block edges (64 rows a task, in
# tiles of 16: experts of ~50 and ~250 rows end on a 3- or 4-tile block).
SHAPES = [
    (1, 8, 2, 256, 128),
    (33, 8, 2, 256, 64),
    (100, 8, 2, 128, 64),
    (64, 8, 2, 128, 32),
    (300, 16, 2, 256, 256),
    (77, 16, 4, 128, 32),
    (512, 8, 2, 256, 128),
    (200, 8, 2, 256, 128),
    (1000, 8, 2, 128, 64),
]


def _case(T, E, K, D, F, seed=0):
    return make_case(T, E, K, D, F, dtype=torch.bfloat16, device="cpu", seed=seed + T)


def _same_share(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.view(torch.int16) == b.view(torch.int16)).float().mean().item()


@needs_kernel
def test_the_compiled_kernel_builds_and_runs_here():
    # The development machine and CI have AMX, g++ and ninja: a torch_moe fallback there would hide a broken
    # build behind passing tests, so it fails here instead.
    runs, why = implementation()
    assert runs, why


@needs_kernel
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int16])
def test_router_ids_of_other_integer_types_give_the_same_bits(ids_dtype):
    # The router's int32 ids go to the kernel as they are; int64 is read as it is, others converted.
    case = _case(40, 8, 2, 256, 128)
    out = cpu_moe(*case.args())
    ids = case.topk_ids_TK.to(ids_dtype)
    again = cpu_moe(case.hidden_TD, case.w13_eFD, case.w2_eDF, case.topk_weights_TK, ids)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize(("T", "E", "K", "D", "F"), SHAPES)
def test_matches_torch_moe_and_the_oracle(T, E, K, D, F):
    case = _case(T, E, K, D, F)
    out = cpu_moe(*case.args(), **case.kwargs())
    expected = torch_moe(*case.args(), **case.kwargs())
    ref = case.reference_fp32()
    # torch_moe's roundings: the same error against the oracle (measured equal to 3 digits), and the same
    # bits almost everywhere (the rest: the GEMMs' internal summation order, one bf16 step).
    assert rel_err(out, ref) <= rel_err(expected, ref) * 1.02 + 1e-6
    assert _same_share(out, expected) >= 0.99
    assert (out.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-7


@needs_kernel
@pytest.mark.parametrize(
    "options", [{"silu_slope": 1.5}, {"apply_router_weight_on_input": True}], ids=["silu_slope", "on_input"]
)
def test_options_as_torch_moe(options):
    case = _case(70, 8, 2, 256, 128, seed=3)
    # make_case normalises each token's weights to sum 1; other weights tell where one was applied
    case = dataclasses.replace(case, topk_weights_TK=case.topk_weights_TK * torch.rand(70, 1) * 2)
    out = cpu_moe(*case.args(), **options)
    expected = torch_moe(*case.args(), **options)
    assert _same_share(out, expected) >= 0.99
    assert _same_share(out, cpu_moe(*case.args())) < 0.5  # the option changed the result, as torch_moe's


@needs_kernel
def test_an_expert_map_drops_other_ranks_slots():
    T, E, K, D, F = 50, 8, 2, 256, 64
    case = _case(T, E, K, D, F, seed=4)
    expert_map_E = torch.full((E,), -1, dtype=torch.int32)
    expert_map_E[4:] = torch.arange(4, dtype=torch.int32)  # this rank holds experts 4..7
    w13, w2 = case.w13_eFD[4:].contiguous(), case.w2_eDF[4:].contiguous()
    args = (case.hidden_TD, w13, w2, case.topk_weights_TK, case.topk_ids_TK)
    out = cpu_moe(*args, expert_map_E=expert_map_E)
    expected = torch_moe(*args, expert_map_E=expert_map_E)
    assert _same_share(out, expected) >= 0.99
    held_nowhere = ~(case.topk_ids_TK >= 4).any(dim=1)  # tokens none of whose experts is here
    assert held_nowhere.any() and (out[held_nowhere] == 0).all()


@needs_kernel
def test_bitwise_repeatable():
    # No atomics: each token's rows are summed in one fixed (expert) order by one thread.
    for T in (1, 70, 600):
        case = _case(T, 8, 2, 256, 128, seed=5)
        assert torch.equal(cpu_moe(*case.args()), cpu_moe(*case.args()))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_same_tokens_in_other_batches_give_the_same_bits(threads):
    """A token's output is its own rows' arithmetic (each GEMM row alone, the sum in expert order), wherever
    it sits in the batch, whatever the batch size and the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = _case(90, 8, 2, 256, 128, seed=6)
        order = torch.randperm(90, generator=torch.Generator().manual_seed(5))
        shuffled = dataclasses.replace(
            case,
            hidden_TD=case.hidden_TD[order].contiguous(),
            topk_weights_TK=case.topk_weights_TK[order].contiguous(),
            topk_ids_TK=case.topk_ids_TK[order].contiguous(),
        )
        out = cpu_moe(*case.args())
        assert torch.equal(out[order], cpu_moe(*shuffled.args()))
        first_ten = dataclasses.replace(
            case,
            hidden_TD=case.hidden_TD[:10].contiguous(),
            topk_weights_TK=case.topk_weights_TK[:10].contiguous(),
            topk_ids_TK=case.topk_ids_TK[:10].contiguous(),
        )
        assert torch.equal(out[:10], cpu_moe(*first_ten.args()))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_weights_changed_in_place_are_packed_again():
    # The golden's probe and the mutations change weights in place: a stale packed copy would serve the old.
    case = _case(20, 8, 2, 256, 128, seed=7)
    before = cpu_moe(*case.args())
    case.w13_eFD[:, 128:].mul_(1.5)  # every expert's up rows
    after = cpu_moe(*case.args())
    assert _same_share(after, torch_moe(*case.args())) >= 0.99
    assert not torch.equal(before, after)


def test_falls_back_to_torch_moe_where_the_kernel_does_not_fit(monkeypatch):
    assert not fits("cpu", torch.float32, 256, 256, 2)  # fp32: the kernel is bf16 only
    assert not fits("cpu", torch.bfloat16, 96, 256, 2)  # D not a multiple of 64
    assert not fits("cuda", torch.bfloat16, 256, 256, 2)
    case = make_case(9, 8, 2, 96, 32, dtype=torch.bfloat16, device="cpu", seed=8)  # D = 96
    calls = []
    monkeypatch.setattr(cpu_moe_module, "torch_moe", lambda *a, **k: calls.append(1) or torch_moe(*a, **k))
    assert torch.equal(cpu_moe(*case.args()), torch_moe(*case.args()))
    assert calls == [1]


def test_disabled_by_the_environment_says_so(monkeypatch):
    monkeypatch.setenv(cpu_moe_module.DISABLE_ENV, "0")
    implementation.cache_clear()
    try:
        runs, why = implementation()
        assert not runs and why == f"torch_moe: {cpu_moe_module.DISABLE_ENV}=0"
    finally:
        implementation.cache_clear()


@pytest.mark.parametrize("refused", ["no AMX CPU", "the OS refuses tile data"])
def test_where_the_tiles_are_not_ours_torch_moe_serves_and_says_why(monkeypatch, refused):
    # A tile instruction there would be SIGILL: the kernel must never be called.
    monkeypatch.delenv(cpu_moe_module.DISABLE_ENV, raising=False)
    if refused == "no AMX CPU":
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        expected = "torch_moe: this CPU has no AMX tiles"
    else:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # on any CPU, AMX or not
        refusing = type("Refusing", (), {"amx_ready": staticmethod(lambda: False)})
        monkeypatch.setattr(cpu_moe_module, "_module", lambda: refusing)
        expected = "torch_moe: the OS refused this process AMX tile data"
    implementation.cache_clear()
    try:
        runs, why = implementation()
        assert not runs and why.startswith(expected), why
        case = _case(9, 8, 2, 256, 128)
        assert torch.equal(cpu_moe(*case.args()), torch_moe(*case.args()))
    finally:
        implementation.cache_clear()


@needs_kernel
def test_per_call_weight_copies_under_inference_mode():
    # vLLM runs the forward under inference_mode: the copies extra_weight_copy and bf16_down_accumulation make
    # at every call are inference tensors, with no version counter to key a packed copy on.
    case = _case(30, 8, 2, 256, 128, seed=9)
    with torch.inference_mode():
        w13, w2 = case.w13_eFD.clone(), case.w2_eDF.clone()
        out = cpu_moe(case.hidden_TD, w13, w2, case.topk_weights_TK, case.topk_ids_TK)
    assert torch.equal(out, cpu_moe(*case.args()))


@needs_kernel
def test_no_tokens_and_slots_of_no_expert():
    case = _case(0, 8, 2, 256, 128)
    assert cpu_moe(*case.args()).shape == (0, 256)
    case = _case(12, 8, 2, 256, 128, seed=10)
    expert_map_E = torch.full((8,), -1, dtype=torch.int32)  # this rank holds none of them
    args = (case.hidden_TD, case.w13_eFD[:1].contiguous(), case.w2_eDF[:1].contiguous())
    out = cpu_moe(*args, case.topk_weights_TK, case.topk_ids_TK, expert_map_E=expert_map_E)
    assert (out == 0).all()


@needs_kernel
def test_bf16_router_weights_as_torch_moe():
    case = _case(40, 8, 2, 256, 128, seed=11)
    bf16 = dataclasses.replace(case, topk_weights_TK=case.topk_weights_TK.bfloat16())
    assert _same_share(cpu_moe(*bf16.args()), torch_moe(*bf16.args())) >= 0.99


def _copied_build_with_torch_lock(tmp_path):
    """A copy of the built kernel (its times kept: loaded, not rebuilt) holding torch's `lock` file, and the
    environment that makes a fresh process load from it."""
    assert implementation()[0]  # built (install.sh builds it; alone, a test builds it here)
    build = tmp_path / "build"
    shutil.copytree(cpu_moe_module.build_dir(), build)
    lock = build / "lock"
    lock.write_text("")
    return lock, {**os.environ, cpu_moe_module.BUILD_DIR_ENV: str(build)}


LOAD = [sys.executable, "-c", "from moe_eval.kernels.cpu_moe import implementation as i; print(i())"]
LOADED = f"(True, {cpu_moe_module.COMPILED!r})"


@needs_kernel
def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path):
    """A killed build leaves torch's `lock` file behind, and torch waits on it without end: the next server
    would hang at weight loading. The builder's own lock (dropped by the OS with its holder) tells such a
    leftover from a live build, and it is removed."""
    lock, env = _copied_build_with_torch_lock(tmp_path)  # what a build killed midway leaves
    stale = time.time() - cpu_moe_module.LIVE_BUILD_SECONDS - 1
    os.utime(lock, (stale, stale))
    loaded = subprocess.run(LOAD, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert LOADED in loaded.stdout, loaded.stdout + loaded.stderr[-2000:]
    assert "left by a build that did not finish" in loaded.stderr
    assert not lock.exists()


@needs_kernel
@pytest.mark.parametrize("live", [True, False])
def test_a_young_lock_file_is_waited_on_while_a_build_works_and_removed_when_none_does(tmp_path, live):
    """torch's lock with a process working in the build folder (torch runs ninja there) may be a live build
    outside our lock (an older checkout sharing the environment, or ninja orphaned by a SIGKILL to its Python
    alone): waited on until it goes. With none, it is a leftover however young, and removed at once."""
    lock, env = _copied_build_with_torch_lock(tmp_path)
    builder = subprocess.Popen(["sleep", "60"], cwd=lock.parent) if live else None  # as a live build's ninja
    started = time.monotonic()
    loading = subprocess.Popen(LOAD, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if builder is not None:
            time.sleep(6)
            assert loading.poll() is None and lock.exists()  # still waiting on the live build
            lock.unlink()  # the live build ends
        out, err = loading.communicate(timeout=300)
    finally:
        if builder is not None:
            builder.kill()
        loading.kill()
    assert loading.returncode == 0 and LOADED in out, out + err[-2000:]
    if live:
        assert "did not finish" not in err and time.monotonic() - started >= 6
    else:
        assert "left by a build that did not finish" in err and time.monotonic() - started < 60
