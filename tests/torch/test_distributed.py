"""docs/semantics.md section 5 and issue 3: distributed amax reduction, DDP, FSDP2 and checkpoints
(gloo, CPU).

Each job starts its ranks once and runs several scenarios in them (``tests/torch/dist_scenarios``;
process start-up dominates on a small machine); every test then checks its scenario's per-rank
results in this process against references computed here (``tests.reference``, docs/semantics.md
worked numbers) or single-process runs.
Every job has a hard time limit, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import kernels
from fp8kit.torch.checkpoint import (
    from_per_rank_fp8_state_dict,
    init_fp8_state,
    per_rank_fp8_state_dict,
)
from fp8kit.torch.ddp import ddp_ignore_fp8_state
from tests.reference import update_reference
from tests.torch.dist_helpers import run_job, scenario_result
from tests.torch.dist_scenarios import (
    MOE_PATTERN_2,
    MOE_PATTERN_4,
    job_four_ranks,
    job_rank_never_arrives,
    job_skipped_backward_with_a_frozen_teacher,
    job_two_ranks,
    mlp,
    moe_amax,
    shard,
)
from tests.torch.module_kinds import FP8_MODULE_KINDS

pytestmark = pytest.mark.multiprocess

E4M3_MAX = 448.0
INPUT, WEIGHT = int(f8.FwdSlot.INPUT), int(f8.FwdSlot.WEIGHT)
GRAD_OUTPUT = int(f8.BwdSlot.GRAD_OUTPUT)


# ---------------------------------------------------------------------------------------------
# Jobs (one of each per test session) and the checks


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(job_two_ranks, 2, tmp_path_factory.mktemp("dist2"), timeout_s=150)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(job_four_ranks, 4, tmp_path_factory.mktemp("dist4"), timeout_s=90)


def f32(x: float) -> float:
    return float(np.float32(x))


def test_spec_item_14_reduction(two: list) -> None:
    per_rank = scenario_result(two, "scenario_spec14")
    for res in per_rank:
        fwd = res["True"]["forward"]
        assert fwd["scale"][INPUT] == f32(np.float32(448) / np.float32(5))  # 89.6
        assert fwd["history"][-1][INPUT] == 5.0
        assert fwd["history"][0] == [0.0, 0.0, 0.0]
    assert per_rank[0]["True"] == per_rank[1]["True"]


def test_spec_item_14_without_reduction(two: list) -> None:
    per_rank = scenario_result(two, "scenario_spec14")
    scales = [res["False"]["forward"]["scale"][INPUT] for res in per_rank]
    assert scales == [224.0, f32(np.float32(448) / np.float32(5))]
    assert [res["False"]["forward"]["history"][-1][INPUT] for res in per_rank] == [2.0, 5.0]


def test_one_all_reduce_per_direction_per_event(two: list) -> None:
    for res in scenario_result(two, "scenario_collective_count"):
        for n_modules in ("1", "6"):
            steps = res[n_modules]
            assert [s["all_reduce"] for s in steps] == [2, 2, 2], n_modules
            # The layout check runs once per direction, at the first event only.
            assert [s["all_gather"] for s in steps] == [2, 0, 0], n_modules
            assert [s["all_gather_object"] for s in steps] == [0, 0, 0], n_modules


@pytest.mark.skipif(
    not kernels.native_available(), reason="counts the native update's ops (native unavailable)"
)
def test_steady_reduced_event_makes_no_tensor_from_host_data(two: list) -> None:
    """A steady-state event with reduction: the buffer (one cat into the registry's buffer),
    the all-reduce, one host read of its three-float trailer, then the bound update kernel
    reading the reduced row where it is (a native call, no aten op): three kernels on CUDA, the
    budget of issue 9. No tensor from Python numbers (``lift_fresh``: on CUDA a blocking copy
    from pageable memory), no copy of the reduced row and no masking ops."""
    views = {"aten.slice.Tensor", "aten.select.int"}
    for res in scenario_result(two, "scenario_collective_count"):
        for n_modules in ("1", "6"):
            events = res[f"{n_modules} event ops"]
            assert len(events) == 2, n_modules  # forward, backward
            for ops in events:
                launched = {name: k for name, k in ops.items() if name not in views}
                assert launched == {
                    "aten.cat.out": 1,
                    "c10d.allreduce_.default": 1,
                    "host reads": 1,
                }, n_modules


def _moe_reference(
    pattern: list, weight_amax: list[float], history_len: int = 4
) -> list[list[dict[str, np.ndarray]]]:
    """Forward states per step and expert from docs/semantics.md sections 3/5 with
    tests.reference.update_reference."""
    recipe = DelayedScaling(amax_history_len=history_len)
    n_experts = len(pattern[0][0])
    h = [np.zeros((history_len, 3), np.float32) for _ in range(n_experts)]
    s = [np.ones(3, np.float32) for _ in range(n_experts)]
    c = [np.zeros(3, np.int64) for _ in range(n_experts)]
    out = []
    for step, ranks in enumerate(pattern):
        per_expert = []
        for e in range(n_experts):
            ran = [r for r in range(len(ranks)) if ranks[r][e]]
            if ran:  # the all-reduced staging row: max over the ranks that ran
                h[e][0, INPUT] = max(np.float32(moe_amax(step, r, e)) for r in ran)
                h[e][0, WEIGHT] = weight_amax[e]
            h[e], s[e], c[e] = update_reference(h[e], s[e], c[e], recipe, E4M3_MAX)
            per_expert.append({"history": h[e].copy(), "scale": s[e].copy(), "count": c[e].copy()})
        out.append(per_expert)
    return out


def _check_moe(per_rank: list, pattern: list) -> None:
    first = per_rank[0]
    for res in per_rank[1:]:  # identical histories and scales on every rank, every step
        assert res["steps"] == first["steps"]
        assert res["weight_amax"] == first["weight_amax"]
    expected = _moe_reference(pattern, first["weight_amax"])
    for step, experts in enumerate(first["steps"]):
        for e, meta in enumerate(experts):
            ref = expected[step][e]
            np.testing.assert_array_equal(np.float32(meta["forward"]["history"]), ref["history"])
            np.testing.assert_array_equal(np.float32(meta["forward"]["scale"]), ref["scale"])
            assert meta["forward"]["count"] == ref["count"].tolist()
            # Backward: the grad-output slot rolls iff some rank ran the expert this step.
            ran_steps = sum(any(r[e] for r in pattern[k]) for k in range(step + 1))
            assert meta["backward"]["count"][GRAD_OUTPUT] == ran_steps


def test_modules_skipped_on_some_ranks_two_ranks(two: list) -> None:
    _check_moe(scenario_result(two, "scenario_moe"), MOE_PATTERN_2)


def test_a_callable_algorithm_with_modules_skipped_on_some_ranks_matches_the_builtin(
    two: list,
) -> None:
    assert scenario_result(two, "scenario_moe_callable") == scenario_result(two, "scenario_moe")


def test_modules_skipped_on_some_ranks_four_ranks(four: list) -> None:
    _check_moe(scenario_result(four, "scenario_moe"), MOE_PATTERN_4)


def test_skipped_everywhere_keeps_state(two: list) -> None:
    """Expert 1 runs on no rank in step 2 (index 1): its state is untouched on every rank."""
    steps = scenario_result(two, "scenario_moe")[0]["steps"]
    assert steps[1][1] == steps[0][1]
    assert steps[2][0] == steps[1][0]  # expert 0 runs nowhere in step 3 (index 2)


def test_layout_mismatch_first_step_raises_on_every_rank(two: list) -> None:
    messages = [res["message"] for res in scenario_result(two, "scenario_mismatch_first_step")]
    for message in messages:
        assert message is not None
        assert "rank 0 registered 1 FP8 module " in message
        assert "rank 1 registered 2 FP8 modules " in message
        assert "every FP8 module must run on every rank in the first step" in message
    assert messages[0] == messages[1]


def test_layout_mismatch_four_ranks_names_rank_sets(four: list) -> None:
    messages = [res["message"] for res in scenario_result(four, "scenario_mismatch_first_step")]
    assert len(set(messages)) == 1
    assert "ranks 0, 2 registered 1 FP8 module " in messages[0]
    assert "ranks 1, 3 registered 2 FP8 modules " in messages[0]


def test_module_first_run_on_one_rank_later_raises_on_every_rank(two: list) -> None:
    messages = [res["message"] for res in scenario_result(two, "scenario_mismatch_later_step")]
    for message in messages:
        assert message is not None
        assert "rank 0 registered 1 FP8 module " in message
        assert "rank 1 registered 2 FP8 modules " in message


def test_a_skipped_backward_pass_raises_on_every_rank(two: list) -> None:
    messages = [res["message"] for res in scenario_result(two, "scenario_skipped_backward")]
    for message in messages:
        assert message is not None
        assert "at different update events (forward vs backward)" in message
    assert messages[0] == messages[1]


def test_every_backward_pass_of_a_step_runs_the_armed_events(two: list) -> None:
    per_rank = scenario_result(two, "scenario_backward_passes_of_one_step")
    assert [res["reduction_error"] for res in per_rank] == [None, None]
    assert per_rank[0] == per_rank[1]
    # Two backward events per step for six steps, for both modules, also on rank 1, where the
    # expert's gradient ran only in step 0 and in the first microbatches.
    for name in ("gate", "expert"):
        assert per_rank[1][name]["backward"]["count"][GRAD_OUTPUT] == 12.0
    # The expert's forward: one event per forward exit (3 steps, then 2 per step).
    assert per_rank[1]["expert"]["forward"]["count"][INPUT] == 9.0


def test_registry_change_on_all_ranks_is_rechecked(two: list) -> None:
    per_rank = scenario_result(two, "scenario_registry_changes")
    assert per_rank[0]["steps"] == per_rank[1]["steps"]
    steps = per_rank[0]["steps"]
    # Layout checks: first events (step 1), module b added (step 2), b deleted (step 4).
    assert [s["counts"]["all_gather"] for s in steps] == [2, 2, 0, 2, 0]
    # One all-reduce per direction per event, plus one re-reduction when a change is flagged.
    assert [s["counts"]["all_reduce"] for s in steps] == [2, 4, 2, 4, 2]
    # b saw input amaxes 4/6 (step 2) and 5/7 (step 3) on ranks 0/1: the maxima are kept.
    b = steps[2]["b"]["forward"]
    assert [row[INPUT] for row in b["history"]][-2:] == [6.0, 7.0]
    assert b["scale"][INPUT] == f32(np.float32(448) / np.float32(7))


def test_no_grad_staging_stays_local(two: list) -> None:
    b0, b1 = (res["b"] for res in scenario_result(two, "scenario_no_grad_leftover"))
    # Step 2: b ran nowhere with grad; rank 0's no_grad amax 9 stays staged on rank 0 only.
    assert b0[1]["history"][0][INPUT] == 9.0 and b1[1]["history"][0][INPUT] == 0.0
    assert b0[1]["history"][1:] == b1[1]["history"][1:] == b0[0]["history"][1:]
    assert b0[1]["count"] == b1[1]["count"] == b0[0]["count"]
    # Step 3: b ran on rank 1 (amax 3): rolled with 3 on both ranks, which are identical again.
    assert b0[2] == b1[2]
    assert b0[2]["history"][-1][INPUT] == 3.0 and b0[2]["count"][INPUT] == 2


def test_kept_reduction_buffers_survive_inference_mode_and_default_dtype(two: list) -> None:
    """Calibration under torch.inference_mode, then training, reduces over both ranks (the
    reduction buffer made in inference mode is an ordinary tensor); a float64 default dtype
    leaves the buffer float32. Rank 1's amaxes are the larger: every rank holds them."""
    r0, r1 = scenario_result(two, "scenario_kept_reduction_buffers")
    assert r0 == r1
    calibrated, trained = r0["calibrated"], r0["trained"]
    assert calibrated["count"][INPUT] == 2 and calibrated["history"][-1][INPUT] == 2.0
    assert trained["forward"]["count"][INPUT] == 4
    assert trained["forward"]["history"][-1][INPUT] == 3.0
    assert r0["float64 default"]["forward"]["history"][-1][INPUT] == 4.0


def _close(a: list, b: list, rtol: float) -> None:
    for x, y in zip(a, b, strict=True):
        x, y = torch.tensor(x), torch.tensor(y)
        err = (x - y).norm() / y.norm()
        assert err <= rtol, f"relative error {float(err):.3g} > {rtol}"


def _check_parity(per_rank: list) -> None:
    run0, run1 = per_rank[0]["run"], per_rank[1]["run"]
    reference = per_rank[0]["reference"]
    for step, (a, b, ref) in enumerate(zip(run0, run1, reference, strict=True)):
        assert a["states"] == b["states"], f"FP8 states differ across ranks after step {step + 1}"
        assert a["grads"] == b["grads"]
        # The reduced forward amaxes are the global batch's: states equal the single process's.
        for mine, single in zip(a["states"], ref["states"], strict=True):
            assert mine["forward"] == single["forward"], f"step {step + 1}"
            # Each rank's mean loss has half the rows, so dY (and its amax) is exactly twice the
            # single process's and the grad-output scale exactly half: the same FP8 codes.
            assert mine["backward"]["scale"][GRAD_OUTPUT] == (
                single["backward"]["scale"][GRAD_OUTPUT] / 2
            )
        # Same FP8 codes everywhere: only float32 summation order differs.
        _close(a["grads"], ref["grads"], rtol=1e-4)


def test_ddp_matches_single_process(two: list) -> None:
    _check_parity(scenario_result(two, "scenario_ddp"))


def test_fsdp2_matches_single_process(two: list) -> None:
    _check_parity(scenario_result(two, "scenario_fsdp2"))


def test_compiled_ddp_trains_like_eager_ddp(two: list) -> None:
    """FP8 modules traced by torch.compile inside DDP: gradients and every FP8 state equal the
    eager DDP run's on every rank, step by step (the amax reduction runs outside the graph)."""
    for per_rank in scenario_result(two, "scenario_ddp_compiled"):
        assert per_rank["compiled"] == per_rank["eager"]


def test_ddp_without_reduction_keeps_rank_states(two: list) -> None:
    per_rank = scenario_result(two, "scenario_ddp_independent")
    assert per_rank[0]["ignored"][0] == "0.fp8_meta.forward.amax_history"
    # Called on the wrapper it used to return the names and change nothing (decision 0248).
    assert len(per_rank[0]["on_wrapper"]) == 2
    for message in per_rank[0]["on_wrapper"]:  # DDP, and DDP under torch.compile
        assert "before wrapping" in message
    # Inputs differ (rank 1's rows are 4x larger): each rank's history holds only the amaxes it
    # saw itself; DDP's buffer broadcast would have put rank 0's into rank 1's older rows.
    for rank, res in enumerate(per_rank):
        local_amax = float(shard(rank, 2)[0].abs().max())
        history = res["run"][1]["states"][0]["forward"]["history"]
        assert [row[INPUT] for row in history[-2:]] == [local_amax, local_amax]
    assert per_rank[0]["run"][1]["states"] != per_rank[1]["run"][1]["states"]


def test_modules_copy_and_pickle_after_a_step_with_a_reduction_group(two: list) -> None:
    for res in scenario_result(two, "scenario_copy_with_group"):
        assert res == {kind: [True, True] for kind in FP8_MODULE_KINDS}


def test_checkpoint_any_rank_resumes_every_rank(two: list) -> None:
    per_rank = scenario_result(two, "scenario_checkpoint_resume")
    for res in per_rank:
        assert res["True"]["resumed"] == res["True"]["continued"]
    assert (
        per_rank[0]["True"]["continued"][-1]["states"]
        == (per_rank[1]["True"]["continued"][-1]["states"])
    )


def test_checkpoint_per_rank_without_reduction(two: list) -> None:
    per_rank = scenario_result(two, "scenario_checkpoint_resume")
    for res in per_rank:
        assert res["False"]["resumed"] == res["False"]["continued"]
    assert (
        per_rank[0]["False"]["continued"][-1]["states"]
        != (per_rank[1]["False"]["continued"][-1]["states"])
    )


def test_dcp_round_trip_fsdp2(two: list) -> None:
    for res in scenario_result(two, "scenario_dcp_fsdp2"):
        assert res["resumed"] == res["continued"]
        assert res["unsized_error"] is not None and "amax_history" in res["unsized_error"]


def test_dcp_per_rank_state_without_reduction(two: list) -> None:
    per_rank = scenario_result(two, "scenario_dcp_per_rank")
    for res in per_rank:
        assert res["resumed"] == res["continued"]


def test_example_trains_with_ddp_and_fsdp2(two: list) -> None:
    losses = scenario_result(two, "scenario_example")[0]
    # Same data, same initial weights, same FP8 states: the wrappers agree closely.
    assert math.isfinite(losses["ddp"]) and losses["ddp"] == pytest.approx(losses["fsdp2"], 1e-4)


def test_a_skipped_backward_pass_raises_also_with_a_frozen_teacher(tmp_path: Path) -> None:
    """Forward events hold a module the backward events never see; the skipped pass is still
    named on every rank (not a timeout: the group's is 10 s here, run_job allows 60)."""
    results = run_job(
        job_skipped_backward_with_a_frozen_teacher, 2, tmp_path, timeout_s=60, pg_timeout_s=10
    )
    messages = [res["message"] for res in results]
    for message in messages:
        assert message is not None
        assert "at different update events (forward vs backward)" in message, message
    assert messages[0] == messages[1]


def test_rank_that_never_arrives_fails_within_timeout(tmp_path: Path) -> None:
    res = run_job(job_rank_never_arrives, 2, tmp_path, timeout_s=180, pg_timeout_s=4)[0]
    assert res["message"] is not None
    # The layout check of the first event waited for rank 1 and gave up at the group's timeout.
    assert res["message"].startswith("fp8kit: the forward FP8 state layout check over WORLD")
    assert "Timed out" in res["message"]  # a hang instead would fail run_job's 180 s limit


# ---------------------------------------------------------------------------------------------
# Single-process checks of the pieces


def test_describe_mismatch_groups_ranks() -> None:
    from fp8kit.torch.distributed import Layout, describe_mismatch

    recipe = DelayedScaling(amax_history_len=4)
    one = Layout.of("forward", recipe, [3]).describe()
    two_ = Layout.of("forward", recipe, [3, 3]).describe()
    text = describe_mismatch([one, two_, one], [0, 1, 2])
    assert text.startswith("ranks 0, 2 registered 1 FP8 module for the forward reduction (slots")
    assert (
        "rank 1 registered 2 FP8 modules for the forward reduction (slots per module [3, 3]" in text
    )
    other = Layout.of("forward", DelayedScaling(amax_history_len=4, margin=1), [3]).describe()
    assert "the recipes differ" in describe_mismatch([one, other], [0, 1])
    back = Layout.of("backward", recipe, [2]).describe()
    assert "forward vs backward" in describe_mismatch([one, back], [0, 1])


def test_layout_validates_direction() -> None:
    from fp8kit.torch.distributed import Layout

    with pytest.raises(ValueError, match="direction"):
        Layout.of("sideways", DelayedScaling(), [3])


def test_single_process_does_not_reduce() -> None:
    from fp8kit.torch.distributed import reduction_active
    from fp8kit.torch.state import update_states

    assert not dist.is_initialized()
    assert not reduction_active(DelayedScaling(), None)
    with pytest.raises(ValueError, match="direction"):
        update_states([], DelayedScaling(), E4M3_MAX, direction="up")


def test_init_fp8_state_sizes_states() -> None:
    model = f8.convert_model(mlp())
    init_fp8_state(model, DelayedScaling(amax_history_len=8))
    for layer in (model[0], model[2]):
        assert layer.fp8_meta.forward.amax_history.shape == (8, 3)
        assert layer.fp8_meta.backward.amax_history.shape == (8, 2)
        assert layer.fp8_meta.forward.recipe_data["amax_history_len"] == 8
    with pytest.raises(TypeError, match="recipe"):
        init_fp8_state(model, f8.Float8CurrentScaling())
    with pytest.raises(TypeError, match="model"):
        init_fp8_state("not a model")  # type: ignore[arg-type]


def test_init_fp8_state_on_the_meta_device_then_to_empty() -> None:
    """The FSDP2 order (build on meta, convert, init_fp8_state, shard, to_empty) read the meta
    history's values and failed (decision 0248); after to_empty the model trains like one built
    on the CPU with the same recipe."""
    recipe = DelayedScaling(amax_history_len=8)
    torch.manual_seed(0)
    reference = f8.convert_model(mlp())
    init_fp8_state(reference, recipe)
    with torch.device("meta"):
        model = f8.convert_model(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a meta state is pristine: no resize warning
        init_fp8_state(model, recipe)
    assert model[0].fp8_meta.forward.amax_history.shape == (8, 3)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 16)
    for m in (reference, model):
        with f8.autocast(recipe=recipe):
            m(x).square().sum().backward()
    got = model.state_dict()
    for name, value in reference.state_dict().items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)
        else:
            assert got[name] == value, name


def test_per_rank_keys_round_trip() -> None:
    model = f8.convert_model(mlp())
    sd = model.state_dict()
    keyed = per_rank_fp8_state_dict(sd, model, rank=3)
    assert "0.fp8_meta.forward.amax_history.rank3" in keyed
    assert "0.fp8_meta.forward.amax_history" not in keyed
    assert "0.weight" in keyed
    back = from_per_rank_fp8_state_dict(keyed, model, rank=3)
    assert back.keys() == sd.keys()
    with pytest.raises(KeyError, match="rank 2"):
        from_per_rank_fp8_state_dict(keyed, model, rank=2)


def test_per_rank_keys_match_get_model_state_dict_of_a_wrapped_model() -> None:
    """``get_model_state_dict`` leaves wrapper attributes (here torch.compile's ``_orig_mod``,
    as DDP's ``module``) out of its keys: the FP8 keys are found under either spelling, and a
    state dict of another model raises instead of being passed through unranked."""
    model = torch.compile(f8.convert_model(mlp()))  # an OptimizedModule; nothing is compiled
    for sd, prefix in ((model.state_dict(), "_orig_mod."), (get_model_state_dict(model), "")):
        keyed = per_rank_fp8_state_dict(sd, model, rank=1)
        assert f"{prefix}0.fp8_meta.forward.amax_history.rank1" in keyed
        assert not any(k.endswith("fp8_meta.forward.scale") for k in keyed)
        assert sum(k.endswith(".rank1") for k in keyed) == 2 * 2 * 3  # 2 layers x 2 dirs x 3
        back = from_per_rank_fp8_state_dict(keyed, model, rank=1)
        assert back.keys() == sd.keys()
    with pytest.raises(ValueError, match=r"none of model's FP8 state keys .*amax_history"):
        per_rank_fp8_state_dict(mlp().state_dict(), model, rank=1)


def test_ddp_ignore_lists_fp8_buffers() -> None:
    model = f8.convert_model(mlp())
    names = ddp_ignore_fp8_state(model)
    assert "2.fp8_meta.backward.update_count" in names
    assert not any("weight" in n or n.endswith("bias") for n in names)
    assert set(names) <= set(model._ddp_params_and_buffers_to_ignore)
    # 2 layers x 2 directions x (history, scale, inv, 2 counts, op token)
    assert len(names) == 2 * 2 * 6
