"""fp8kit.torch.inspect: statistics against hand-computed values, naming, sampling, exports."""

from __future__ import annotations

import copy
import csv
import gc
import json
import math
import sys
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch import kernels, slot_cast
from fp8kit.torch.checkpoint import init_fp8_state
from fp8kit.torch.inspect import Inspector, attached_inspector, cast_statistics
from fp8kit.torch.inspect import stats as stats_module
from fp8kit.torch.inspect.export import DEFINITIONS, METRICS, write_tensorboard
from fp8kit.torch.inspect.inspector import SlotStats
from fp8kit.torch.inspect.stats import snr_db
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
    assert attached_inspector() is None, "a test left an inspector attached"


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


def test_energies_of_a_huge_finite_input_stay_finite() -> None:
    """|x| = 1e20 squares to 1e40, past float32's range: the energies (and so the SNR) must
    still be the finite float64 values, as the stats module's docstring promises."""
    x = torch.tensor([1e20, 1.0, 2.0])
    q = quantize(x, 1.0, torch.float8_e4m3fn)
    assert q.dequantize().tolist() == [448.0, 1.0, 2.0]
    *_, signal, noise = cast_statistics(x, q, torch.tensor(1.0), 448.0).tolist()
    big = float(np.float32(1e20))  # the cast reads float32(x)
    assert signal == pytest.approx(big**2 + 1.0 + 4.0, rel=1e-12)
    assert noise == pytest.approx((big - 448.0) ** 2, rel=1e-12)
    expected = 10 * math.log10((big**2 + 5.0) / (big - 448.0) ** 2)
    assert snr_db(signal, noise) == pytest.approx(expected, abs=1e-9)


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


_TRAINED_SLOTS = ("INPUT", "WEIGHT", "GRAD_OUTPUT")


def test_names_follow_the_model_and_the_gemms() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].qkv = LayerNormLinear(16, 48)
    model.blocks[0].mlp = LayerNormMLP(16, 32)
    model.blocks[0].attn = f8.MultiheadAttention(16, 2)
    x = torch.randn(4, 16, requires_grad=True)
    inspector = Inspector(model)
    with inspector:
        with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
            y = model.blocks[0].mlp(model.blocks[0].qkv(x)[:, :16])
            z = model.blocks[0].attn(y, x, x, need_weights=False)[0]  # cross: q, k, v apart
        z.sum().backward()
        names = {r.name for r in inspector.step()}
    assert names == {
        *(f"blocks.0.attn.{g}.{s}" for g in ("q", "k", "v", "out") for s in _TRAINED_SLOTS),
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


def _one_step(model: nn.Module) -> None:
    """Forward and backward of ``model`` (``f8.Linear(8, 8)`` layers) under delayed scaling."""
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = model(torch.randn(4, 8))
    y.sum().backward()


def test_second_attach_raises_while_the_first_is_paused_or_between_samples() -> None:
    """The first inspector's observer is not installed while it is paused or on a step it does
    not sample; a second attach must raise then too, naming how to detach the first."""
    model = nn.Sequential(f8.Linear(8, 8))
    first = Inspector(model, every=2).attach()
    try:
        assert attached_inspector() is first
        with first.paused():
            assert slot_cast._observer is None
            with pytest.raises(RuntimeError, match=r"already attached.*\.detach\(\)"):
                Inspector(model).attach()
        _one_step(model)
        first.step()  # step 1 comes next: not sampled, observer not installed
        assert slot_cast._observer is None
        with pytest.raises(RuntimeError, match="already attached"):
            Inspector(model).attach()
        _one_step(model)
        assert first.step() == []
        _one_step(model)
        assert {r.step for r in first.step()} == {2}  # nothing was stolen
    finally:
        first.detach()
    second = Inspector(model).attach()
    assert attached_inspector() is second
    second.detach()


def test_an_attached_inspector_that_is_dropped_detaches_itself() -> None:
    """Neither the installed hook nor the attachment keeps a dropped inspector alive: once it
    is collected, its observer is gone and a new inspector attaches."""
    model = nn.Sequential(f8.Linear(8, 8))
    dropped = Inspector(model).attach()
    _one_step(model)
    assert slot_cast._observer is not None  # installed: step 1 is sampled too
    ref = weakref.ref(dropped)
    del dropped
    assert ref() is None and slot_cast._observer is None and attached_inspector() is None
    # Stored on its own model it sits in a reference cycle (model -> inspector -> model) that
    # only the cycle collector frees; the next attach runs it before giving up.
    looped = nn.Sequential(f8.Linear(8, 8))
    looped.inspector = Inspector(looped).attach()
    ref = weakref.ref(looped.inspector)
    gc.disable()  # no automatic collection: only attach() may free the cycle
    try:
        del looped
        assert ref() is not None  # unreachable, not freed yet
        other = nn.Sequential(f8.Linear(8, 8))
        new = Inspector(other).attach()
    finally:
        gc.enable()
    assert ref() is None and attached_inspector() is new
    _one_step(other)
    assert len(new.step()) == 3
    new.detach()


def test_explicit_step_numbers_record_the_multiples_of_every() -> None:
    """step(n) with n = 1..24 and every=10 records steps 10 and 20 (the multiples of ``every``
    among the numbers passed), numbering from 0 adds step 0."""
    model = nn.Sequential(f8.Linear(8, 8))
    for numbers in (range(1, 25), range(0, 25), range(1000, 1025)):
        inspector = Inspector(model, every=10)
        with inspector:
            for n in numbers:
                _one_step(model)
                inspector.step(n)
        expected = [n for n in numbers if n % 10 == 0]
        assert sorted({r.step for r in inspector.records}) == expected, numbers
        assert len(inspector.records) == 3 * len(expected)


class _HostReads(TorchFunctionMode):
    """Counts the tensor methods that copy device values to Python objects."""

    READS = ("tolist", "item", "numpy", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_step_reads_the_device_once() -> None:
    """ADR 0402: closing a step copies its statistics (and the non-finite event counts) to the
    host in one transfer."""
    model = nn.Sequential(f8.Linear(8, 8), f8.Linear(8, 8))
    with Inspector(model) as inspector:
        _one_step(model)
        with _HostReads() as reads:
            records = inspector.step()
    assert len(records) == 6 and reads.calls == ["tolist"]
    assert all(r.nonfinite_events == 0 for r in records)


@pytest.mark.skipif(
    not kernels.native_available(),
    reason="the torch update event reads its CPU counts in place (numpy), no device involved",
)
def test_first_step_current_scaling_is_reported_without_reading_the_device() -> None:
    """Under ``first_step_scaling="current"`` a slot's first cast uses ``fmax / amax`` of its
    tensor, later casts the delayed scale; the observer picks which on the device (it used to
    read the update count on the host at every cast until the slot had history)."""
    torch.manual_seed(0)
    model = nn.Sequential(f8.Linear(16, 16))
    recipe = DelayedScaling(amax_history_len=4, first_step_scaling="current")
    init_fp8_state(model, recipe)  # the one-time binding reads the state; steps then do not
    xs = [torch.randn(8, 16) * 3, torch.randn(8, 16) * 5]
    with Inspector(model) as inspector:
        for x in xs:
            with _HostReads() as reads, f8.autocast(recipe=recipe):
                y = model(x)
            assert reads.calls == []
            y.sum().backward()
            inspector.step()
    step0 = {r.slot: r for r in inspector.records if r.step == 0}
    step1 = {r.slot: r for r in inspector.records if r.step == 1}
    amax0 = np.float32(xs[0].abs().max().item())
    assert step0["INPUT"].scale == float(np.float32(448.0) / amax0)  # current, first cast
    assert step1["INPUT"].scale == float(np.float32(448.0) / amax0)  # delayed: event 0's
    assert step1["INPUT"].amax == float(np.float32(xs[1].abs().max().item()))


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
    # a slot typo used to draw an empty column, a plain string one column per letter
    with pytest.raises(ValueError, match=r"^slots must be kinds the records hold \(\['GRAD"):
        inspector.plot(path, slots=("INPTU",))
    with pytest.raises(TypeError, match=r"^slots must be a sequence of slot kinds .*'INPUT'"):
        inspector.plot(path, slots="INPUT")


def test_series_names_an_unknown_slot() -> None:
    """A slot name that is not recorded used to give an empty series, like "no data yet"."""
    inspector = _records_after_two_steps()
    name = inspector.names()[0]
    steps, values = inspector.series(name, "amax")
    assert steps and len(values) == len(steps)
    with pytest.raises(ValueError, match=r"^name must be one of the recorded slots \["):
        inspector.series(name.lower(), "amax")


def _figure_of(monkeypatch: pytest.MonkeyPatch, draw) -> object:
    """The matplotlib Figure that ``draw()`` saves (caught on its way to ``savefig``)."""
    figure_module = pytest.importorskip("matplotlib.figure")
    saved = []
    real = figure_module.Figure.savefig

    def spy(self, *args, **kwargs):
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(figure_module.Figure, "savefig", spy)
    draw()
    (fig,) = saved
    return fig


def _one_step_records(model: nn.Module) -> Inspector:
    inspector = Inspector(model)
    with inspector:
        _one_step(model)
        inspector.step()
    return inspector


def test_plot_draws_a_layer_sampled_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One sampled step gives each layer a single point: it must show up inside the axes (a
    one-point line draws nothing)."""
    backend_agg = pytest.importorskip("matplotlib.backends.backend_agg")
    inspector = _one_step_records(nn.Sequential(f8.Linear(8, 8)))
    path = tmp_path / "one.png"
    fig = _figure_of(monkeypatch, lambda: inspector.plot(path, metrics=["amax"], slots=["WEIGHT"]))
    canvas = backend_agg.FigureCanvasAgg(fig)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[:, :, :3].astype(float) / 255
    (ax,) = fig.axes
    box = ax.get_window_extent()  # display pixels, origin at the bottom left
    height = pixels.shape[0]
    inside = pixels[
        int(height - box.y1) + 2 : int(height - box.y0) - 2, int(box.x0) + 2 : int(box.x1) - 2
    ]
    (color,) = {tuple(line.get_color()[:3]) for line in ax.get_lines()}
    close = np.abs(inside - np.array(color)).max(axis=2) < 0.08
    assert close.sum() >= 10  # a visible marker, not a stray anti-aliased pixel


def test_plot_leaves_the_matplotlib_backend_alone(tmp_path) -> None:
    """A notebook's backend (here svg) stays selected after plotting."""
    matplotlib = pytest.importorskip("matplotlib")
    inspector = _records_after_two_steps()
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        inspector.plot(tmp_path / "s.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_legend_keeps_sequential_layers_apart(tmp_path, monkeypatch) -> None:
    """nn.Sequential children are named "0", "1": the legend must list both names."""
    inspector = _one_step_records(nn.Sequential(f8.Linear(8, 8), f8.Linear(8, 8)))
    fig = _figure_of(monkeypatch, lambda: inspector.plot(tmp_path / "seq.png"))
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["0", "1"]
    colors = {tuple(h.get_color()) for h in legend.legend_handles}
    assert len(colors) == 2


class _Scalars:
    """A stand-in for TensorBoard's SummaryWriter that keeps what ``add_scalar`` got."""

    def __init__(self) -> None:
        self.added: dict[str, list[tuple[int, float]]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.added.setdefault(tag, []).append((step, value))


def test_an_infinite_amax_reaches_tensorboard_and_every_number_is_defined() -> None:
    """TensorBoard takes finite scalars only, so an infinite amax was dropped with no trace;
    the non-finite event count is now exported beside it. The JSON's definitions cover every
    numeric column and the slot's format and direction."""
    base = {"name": "fc.INPUT", "module": "fc", "gemm": "", "direction": "forward"}
    base |= {"slot": "INPUT", "fp8_format": "E4M3", "casts": 1, "numel": 8, "scale": 1.0}
    base |= {"saturated": 0.0, "flushed": 0.0, "snr_db": 30.0}
    records = [
        SlotStats(step=0, amax=2.0, nonfinite_events=0, **base),
        SlotStats(step=1, amax=math.inf, nonfinite_events=1, **base),
    ]
    writer = _Scalars()
    write_tensorboard(records, None, writer=writer)
    assert writer.added["fp8/amax/fc.INPUT"] == [(0, 2.0)]
    assert writer.added["fp8/nonfinite_events/fc.INPUT"] == [(0, 0), (1, 1)]
    numeric = [name for name, value in records[0].to_dict().items() if not isinstance(value, str)]
    missing = set(numeric) - {"step"} - set(DEFINITIONS)
    assert not missing and {"direction", "fp8_format"} <= set(DEFINITIONS)


def test_a_nested_with_block_leaves_the_inspector_attached() -> None:
    """Entering an attached inspector again (a nested ``with``, or ``with`` after ``attach()``)
    must not detach it at that block's end: the outer block's casts went unrecorded, silently.
    The block that attached it detaches it."""
    model = f8.Linear(8, 8)
    inspector = Inspector(model)
    x = torch.randn(4, 8)
    with inspector:
        with inspector:
            pass
        assert inspector.attached and attached_inspector() is inspector
        with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
            model(x).sum().backward()
        assert inspector.step()  # recorded after the inner block closed
    assert not inspector.attached and attached_inspector() is None
    inspector.attach()
    with inspector:
        pass
    assert inspector.attached  # attach() opened it, so the block leaves it open
    inspector.detach()
