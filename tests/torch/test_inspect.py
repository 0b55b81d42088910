"""fp8kit.torch.inspect: statistics against hand-computed values, naming, sampling, exports."""

from __future__ import annotations

import copy
import csv
import json
import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch import slot_cast
from fp8kit.torch.inspect import Inspector, cast_statistics
from fp8kit.torch.inspect import stats as stats_module
from fp8kit.torch.inspect.export import METRICS
from fp8kit.torch.layers import LayerNormLinear, LayerNormMLP
from fp8kit.torch.quantization import quantize

# Ten values cast with scale 1 into E4M3 (fmax 448, smallest subnormal 2^-9 = 0.001953125):
# 1000, -600 and 449 saturate (3 elements); 3e-4 and -9e-4 are below half the smallest
# subnormal and flush to zero (2 elements); 0 is zero already (not "flushed"); the others are
# exact E4M3 values except 0.3 -> 0.3125.
CRAFTED = [1000.0, -600.0, 449.0, 3e-4, -9e-4, 0.0, 1.0, -2.0, 3.0, 0.3]
CRAFTED_Q = [448.0, -448.0, 448.0, 0.0, 0.0, 0.0, 1.0, -2.0, 3.0, 0.3125]


def hand_snr_db(x: list[float], q: list[float]) -> float:
    x32 = [float(np.float32(v)) for v in x]  # the cast reads float32(x)
    signal = sum(v * v for v in x32)
    noise = sum((v - w) ** 2 for v, w in zip(x32, q, strict=True))
    return 10 * math.log10(signal / noise)


@pytest.fixture(autouse=True)
def _no_leftover_observer():
    yield
    assert slot_cast._observer is None, "a test left an inspector attached"


def test_cast_statistics_of_the_crafted_tensor() -> None:
    x = torch.tensor(CRAFTED)
    q = quantize(x, 1.0, torch.float8_e4m3fn)
    assert q.dequantize().tolist() == CRAFTED_Q
    amax, scale, sat, flush, signal, noise = cast_statistics(x, q, torch.tensor(1.0), 448.0)
    assert (amax.item(), scale.item(), sat.item(), flush.item()) == (1000.0, 1.0, 3.0, 2.0)
    snr = 10 * math.log10(signal.item() / noise.item())
    assert snr == pytest.approx(hand_snr_db(CRAFTED, CRAFTED_Q), rel=1e-6)


def test_saturation_uses_the_scale() -> None:
    """With scale 0.5, |x * 0.5| > 448 holds for 1000 only (600 and 449 fit once halved)."""
    x = torch.tensor(CRAFTED)
    q = quantize(x, 0.5, torch.float8_e4m3fn)
    values = cast_statistics(x, q, torch.tensor(0.5), 448.0)
    assert values[2].item() == 1.0
    # Flushed at scale 0.5: 3e-4 and 9e-4 (now 4.5e-4, still below 2^-10).
    assert values[3].item() == 2.0


def test_non_finite_elements() -> None:
    """inf saturates; NaN neither saturates nor flushes nor enters the SNR energies."""
    x = torch.tensor([math.inf, math.nan, 1.0, 2.0])
    q = quantize(x, 1.0, torch.float8_e4m3fn)
    amax, _, sat, flush, signal, noise = cast_statistics(x, q, torch.tensor(1.0), 448.0).tolist()
    assert (amax, sat, flush) == (math.inf, 1.0, 0.0)
    assert signal == 5.0 and noise == 0.0  # only 1 and 2 count, both exact


def _crafted_linear() -> nn.Module:
    """A model whose WEIGHT slot sees exactly the crafted tensor (weight (1, 10))."""
    model = nn.Sequential()
    model.add_module("proj", f8.Linear(10, 1, bias=False))
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([CRAFTED]))
    return model


def test_inspector_reports_hand_computed_values_for_a_module_slot() -> None:
    model = _crafted_linear()
    inspector = Inspector(model)
    x = torch.ones(4, 10, requires_grad=True)
    with inspector:
        with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
            y = model(x)
        y.sum().backward()
        records = {r.name: r for r in inspector.step()}
    assert set(records) == {"proj.INPUT", "proj.WEIGHT", "proj.GRAD_OUTPUT"}
    w = records["proj.WEIGHT"]
    assert (w.module, w.gemm, w.direction, w.slot) == ("proj", "", "forward", "WEIGHT")
    assert w.fp8_format == "float8_e4m3fn" and w.casts == 1 and w.numel == 10
    assert w.amax == 1000.0 and w.scale == 1.0
    assert w.saturated == 3 / 10
    assert w.flushed == 2 / 10
    assert w.snr_db == pytest.approx(hand_snr_db(CRAFTED, CRAFTED_Q), rel=1e-6)
    inp = records["proj.INPUT"]
    assert (inp.amax, inp.saturated, inp.flushed, inp.snr_db) == (1.0, 0.0, 0.0, math.inf)
    g = records["proj.GRAD_OUTPUT"]
    assert g.direction == "backward" and g.fp8_format == "float8_e5m2" and g.numel == 4


def test_step_two_uses_the_delayed_scale_and_current_scaling_its_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(f8.Linear(16, 16))
    inspector = Inspector(model)
    recipe = DelayedScaling(amax_history_len=4)
    with inspector:
        for _ in range(2):
            with f8.autocast(recipe=recipe):
                y = model(torch.randn(8, 16) * 3)
            y.sum().backward()
            inspector.step()
    step0 = {r.slot: r for r in inspector.records if r.step == 0}
    step1 = {r.slot: r for r in inspector.records if r.step == 1}
    assert step0["INPUT"].scale == 1.0
    expected = float(np.float32(448.0) / np.float32(step0["INPUT"].amax))
    assert step1["INPUT"].scale == expected  # event 0's scale, from step 0's amax

    current = Inspector(model)
    x = torch.randn(8, 16) * 3
    with current:
        with f8.autocast(recipe=Float8CurrentScaling()):
            model(x)
        (rec,) = [r for r in current.step() if r.slot == "INPUT"]
    assert rec.scale == float(np.float32(448.0) / np.float32(x.abs().max().item()))
    assert rec.saturated == 0.0


def test_several_casts_in_one_step_combine() -> None:
    """Two microbatches: amax = max, counts and energies add, scale = the last cast's."""
    model = nn.Sequential(f8.Linear(10, 1, bias=False))
    inspector = Inspector(model)
    a = torch.tensor([CRAFTED])
    b = torch.tensor([[2.0] * 10])
    with inspector, f8.autocast(recipe=DelayedScaling(amax_history_len=2)), torch.no_grad():
        model(a)
        model(b)
        (rec,) = [r for r in inspector.step() if r.slot == "INPUT"]
    assert (rec.casts, rec.numel, rec.amax) == (2, 20, 1000.0)
    assert rec.saturated == 3 / 20 and rec.flushed == 2 / 20
    x32 = [float(np.float32(v)) for v in CRAFTED]
    signal = sum(v * v for v in x32) + 10 * 4.0
    noise = sum((v - w) ** 2 for v, w in zip(x32, CRAFTED_Q, strict=True))
    assert rec.snr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-6)


def test_names_follow_the_model_and_the_gemms() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].qkv = LayerNormLinear(16, 48)
    model.blocks[0].mlp = LayerNormMLP(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    inspector = Inspector(model)
    with inspector:
        with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
            y = model.blocks[0].mlp(model.blocks[0].qkv(x)[:, :16])
        y.sum().backward()
        names = {r.name for r in inspector.step()}
    assert names == {
        "blocks.0.qkv.INPUT",
        "blocks.0.qkv.WEIGHT",
        "blocks.0.qkv.GRAD_OUTPUT",
        "blocks.0.mlp.fc1.INPUT",
        "blocks.0.mlp.fc1.WEIGHT",
        "blocks.0.mlp.fc1.GRAD_OUTPUT",
        "blocks.0.mlp.fc2.INPUT",
        "blocks.0.mlp.fc2.WEIGHT",
        "blocks.0.mlp.fc2.GRAD_OUTPUT",
    }


def test_a_module_outside_the_model_is_still_recorded() -> None:
    inspector = Inspector(nn.Linear(2, 2))
    other = f8.Linear(16, 16)
    with inspector, f8.autocast(recipe=DelayedScaling(amax_history_len=2)), torch.no_grad():
        other(torch.randn(2, 16))
        names = sorted(r.name for r in inspector.step())
    assert names == ["<unknown0>.slot0", "<unknown0>.slot1"]


def test_zero_cost_when_off_and_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """No observer without an inspector, while paused, and on unsampled steps."""
    calls = []
    real = stats_module.cast_statistics

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("fp8kit.torch.inspect.inspector.cast_statistics", counting)
    model = nn.Sequential(f8.Linear(16, 16))
    x = torch.randn(4, 16)
    recipe = DelayedScaling(amax_history_len=2)

    def run() -> None:
        with f8.autocast(recipe=recipe), torch.no_grad():
            model(x)

    run()
    assert slot_cast._observer is None and not calls
    inspector = Inspector(model, every=2)
    with inspector:
        assert slot_cast._observer is not None
        for step in range(5):
            run()
            with inspector.paused():
                assert slot_cast._observer is None
                run()
            inspector.step()
            assert (slot_cast._observer is not None) == ((step + 1) % 2 == 0)
    assert slot_cast._observer is None
    assert sorted({r.step for r in inspector.records}) == [0, 2, 4]
    assert len(calls) == 3 * 2  # 3 sampled steps x (INPUT, WEIGHT); paused casts not seen
    assert all(r.casts == 1 for r in inspector.records)


def test_inspector_does_not_change_numerics() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(LayerNormMLP(16, 32))
    x = torch.randn(4, 16)
    recipe = DelayedScaling(amax_history_len=2)
    state = copy.deepcopy(model.state_dict())
    outs = []
    for use in (False, True):
        model.load_state_dict(state)
        inspector = Inspector(model)
        if use:
            inspector.attach()
        for _ in range(2):
            with f8.autocast(recipe=recipe):
                y = model(x)
            y.sum().backward()
            inspector.step()
        inspector.detach()
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])


def test_one_inspector_at_a_time_and_argument_errors() -> None:
    model = nn.Sequential(f8.Linear(4, 4))
    first = Inspector(model).attach()
    try:
        with pytest.raises(RuntimeError, match="already attached"):
            Inspector(model).attach()
    finally:
        first.detach()
    with pytest.raises(TypeError, match="model"):
        Inspector("not a model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        Inspector(model, every=0)
    with pytest.raises(ValueError, match="metric"):
        first.series("x", "loudness")


def _records_after_two_steps() -> Inspector:
    model = _crafted_linear()
    inspector = Inspector(model)
    with inspector:
        for _ in range(2):
            with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
                y = model(torch.ones(4, 10, requires_grad=True))
            y.sum().backward()
            inspector.step()
    return inspector


def test_csv_and_json_exports(tmp_path) -> None:
    inspector = _records_after_two_steps()
    inspector.to_csv(tmp_path / "s.csv")
    inspector.to_json(tmp_path / "s.json")
    with open(tmp_path / "s.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(inspector.records) == 6
    w0 = next(r for r in rows if r["name"] == "proj.WEIGHT" and r["step"] == "0")
    assert float(w0["saturated"]) == 0.3 and float(w0["flushed"]) == 0.2
    payload = json.loads((tmp_path / "s.json").read_text())  # strict JSON (no Infinity)
    assert set(payload["definitions"]) >= {"saturated", "flushed", "snr_db"}
    inp = next(r for r in payload["records"] if r["name"] == "proj.INPUT")
    assert inp["snr_db"] == "inf"
    steps, values = inspector.series("proj.WEIGHT", "amax")
    assert steps == [0, 1] and values == [1000.0, 1000.0]


def test_tensorboard_export_without_tensorboard(tmp_path, monkeypatch) -> None:
    """Where tensorboard is missing the export says how to get it (simulated where it is
    installed: a None entry in sys.modules makes the import fail)."""
    inspector = _records_after_two_steps()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        inspector.to_tensorboard(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def _read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``log_dir``: tag -> [(step, value)] in step order."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_export_reads_back(tmp_path) -> None:
    """A real export, read back with tensorboard's own event reader: one scalar per finite
    metric of every record, tagged fp8/<metric>/<slot>, at the record's step."""
    pytest.importorskip("torch.utils.tensorboard")
    inspector = _records_after_two_steps()
    inspector.to_tensorboard(tmp_path / "tb")
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in inspector.records:
        for metric in METRICS:
            value = getattr(r, metric)
            if math.isfinite(value):  # an exact cast has snr_db = inf: nothing to plot
                expected.setdefault(f"fp8/{metric}/{r.name}", []).append((r.step, value))
    got = _read_scalars(tmp_path / "tb")
    assert set(got) == set(expected)
    for tag, points in expected.items():
        # event files store float32 values
        assert got[tag] == [(step, float(np.float32(v))) for step, v in points], tag
    assert "fp8/snr_db/proj.INPUT" not in got  # inf in both steps
    assert got["fp8/saturated/proj.WEIGHT"][0] == (0, float(np.float32(0.3)))  # 3 of 10

    # An open writer is written into and left open for the caller.
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "own"))
    inspector.to_tensorboard(writer=writer)
    writer.add_scalar("caller/after", 7.0, 3)  # still usable
    writer.close()
    own = _read_scalars(tmp_path / "own")
    assert own.pop("caller/after") == [(3, 7.0)]
    assert own == got


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    inspector = _records_after_two_steps()
    path = tmp_path / "stats.png"
    inspector.plot(path, metrics=("amax", "scale", "saturated", "flushed", "snr_db"))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 300
    with pytest.raises(ValueError, match="metrics"):
        inspector.plot(path, metrics=("loudness",))
