"""The demo: ``fp8kit demo --quick`` end to end, input validation, corpus, bf16 emulation, the
device choice and the charts."""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from fp8kit.__main__ import main as fp8kit_main  # noqa: E402
from fp8kit.demo import charts  # noqa: E402
from fp8kit.demo.cli import MODEL, QUICK_MODEL, parse_options  # noqa: E402
from fp8kit.demo.cli import main as demo_main  # noqa: E402
from fp8kit.demo.corpus import CorpusError, load_corpus, stdlib_files  # noqa: E402
from fp8kit.demo.model import GPT  # noqa: E402
from fp8kit.demo.precision import Bf16Emulation, make_variant  # noqa: E402
from fp8kit.demo.report import (  # noqa: E402
    OUTPUT_FILES,
    RunInfo,
    machine_was_busy,
    speed_note,
)
from fp8kit.demo.train import (  # noqa: E402
    RunResult,
    TrainConfig,
    _evaluate,
    batch_offsets,
    lr_at,
)
from fp8kit.torch.checkpoint import fp8_metas  # noqa: E402

PNGS = ("loss.png", "fp8_amax_scale.png", "fp8_saturation_flush.png")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--quick`` run of all four variants on the CPU, shared by the checks below."""
    out = tmp_path_factory.mktemp("demo") / "out"
    assert demo_main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    return out


def _finite(text: str) -> float:
    value = float(text)
    assert math.isfinite(value), text
    return value


def test_quick_run_writes_report_pngs_and_metrics(quick_run: Path) -> None:
    report = (quick_run / "report.md").read_text()
    for label in ("fp32", "bf16", "FP8 delayed scaling", "FP8 current scaling"):
        assert label in report
    for png in PNGS:
        assert f"]({png})" in report
    assert "## Machine" in report and "## Setup" in report
    assert "- Device: cpu\n" in report
    assert "| speed vs fp32 | speed vs bf16 |" in report
    # what CPU speed figures mean, and where GPU numbers are (no figures of other machines)
    assert "### What the speed figures mean" in report
    assert "This run trained on the CPU, where no FP8 arithmetic exists" in report
    assert "docs/benchmarks.md" in report
    assert "Reproduce: `python -m fp8kit.demo --steps 6 --seed 0 --device cpu --quick`." in report
    assert not re.search(r"\bnan", report)  # Python's spelling of a NaN number
    for name in PNGS:
        data = (quick_run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        import matplotlib.image

        image = matplotlib.image.imread(quick_run / name)  # decodes: a valid image
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 300


def test_quick_run_metrics_hold_finite_numbers(quick_run: Path) -> None:
    with open(quick_run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    variants = {r["variant"] for r in rows}
    assert variants == {"fp32", "bf16", "fp8-delayed", "fp8-current"}
    for r in rows:
        if r["train_loss"]:
            _finite(r["train_loss"])
            _finite(r["step_time_s"])
        if r["val_loss"]:
            _finite(r["val_loss"])
    results = json.loads((quick_run / "results.json").read_text())
    summary = {s["variant"]: s for s in results["summary"]}
    for s in summary.values():
        keys = ("final_train_loss", "final_val_loss", "tokens_per_s", "speed_vs_fp32")
        if not summary["bf16"]["emulated"]:
            keys += ("speed_vs_bf16",)
        for key in keys:
            assert isinstance(s[key], float) and math.isfinite(s[key]), (s["variant"], key)
        assert s["finite"] and s["diverged"] is None
        assert 0.0 < s["final_val_loss"] < math.log(256) + 0.5  # starts near ln 256
    assert summary["fp32"]["gap_to_fp32_percent"] == 0.0
    assert results["quick"] is True
    assert {t["variant"] for t in results["targets"]} == {"fp8-delayed", "fp8-current"}
    with open(quick_run / "fp8_stats.csv", newline="") as f:
        stats = list(csv.DictReader(f))
    assert {r["slot"] for r in stats} == {"INPUT", "WEIGHT", "GRAD_OUTPUT"}
    assert any(r["name"] == "blocks.0.mlp.fc1.INPUT" for r in stats)
    for r in stats:
        for key in ("amax", "scale", "saturated", "flushed"):
            _finite(r[key])
    json.loads((quick_run / "fp8_stats.json").read_text())


def test_same_data_order_and_initial_loss_for_every_variant(quick_run: Path) -> None:
    curves = json.loads((quick_run / "results.json").read_text())["curves"]
    first_val = {name: c["val_loss"][0] for name, c in curves.items()}
    # Same weights and data: the step-0 validation losses agree closely (FP8 and bf16 differ
    # only by rounding), and every curve has one loss per step.
    values = [v for _, v in first_val.values()]
    assert max(values) - min(values) < 0.05
    assert len({len(c["train_loss"]) for c in curves.values()}) == 1


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = demo_main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be between 1"),
        (["--steps", "many"], "--steps must be an integer"),
        (["--variants", "fp32,fp16"], "unknown variant 'fp16'"),
        (["--variants", "fp32,fp32"], "lists a variant twice"),
        (["--variants", ","], "at least one"),
        (["--seed", "-1"], "--seed must be between"),
        (["--bf16", "maybe"], "invalid choice"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_cli([*args, "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_corpus_and_out_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o")
    code, err = _run_cli(["--corpus", str(tmp_path / "missing.txt"), "--out", out], capsys)
    assert code == 2 and "no such file or folder" in err and err.count("\n") == 1
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code, err = _run_cli(["--corpus", str(empty), "--out", out], capsys)
    assert code == 2 and "corpus is empty" in err
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print('hi')\n")
    code, err = _run_cli(["--quick", "--corpus", str(tiny), "--out", out], capsys)
    assert code == 2 and "needs at least" in err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, err = _run_cli(["--out", str(a_file)], capsys)
    assert code == 2 and "not a folder" in err
    code, err = _run_cli(["--out", str(a_file / "sub")], capsys)
    assert code == 2 and "cannot write to folder" in err and "Traceback" not in err


def _stated_minimum(message: str) -> int:
    match = re.search(r"needs at least (\d+) \(", message)
    assert match, message
    return int(match.group(1))


def test_corpus_minimum_in_the_message_is_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The size the error names is the boundary: one byte less is rejected, that many runs."""
    for min_bytes in (34, 130):
        short = tmp_path / f"short{min_bytes}.txt"
        short.write_bytes(b"x" * (9 * min_bytes))
        with pytest.raises(CorpusError) as info:
            load_corpus(short, min_bytes=min_bytes)
        need = _stated_minimum(str(info.value))
        assert f"each part must hold at least {min_bytes} bytes" in str(info.value)
        short.write_bytes(b"x" * (need - 1))
        with pytest.raises(CorpusError):
            load_corpus(short, min_bytes=min_bytes)
        short.write_bytes(b"x" * need)
        corpus = load_corpus(short, min_bytes=min_bytes)
        assert min(corpus.train.numel(), corpus.val.numel()) >= min_bytes
    # The same boundary through the command line (--quick: 32-byte context).
    text = tmp_path / "tiny.txt"
    text.write_text("print('hi')\n")
    code, err = _run_cli(["--quick", "--corpus", str(text), "--out", str(tmp_path / "o")], capsys)
    need = _stated_minimum(err)
    assert code == 2 and "context" not in err
    args = ["--quick", "--steps", "1", "--variants", "fp32", "--device", "cpu"]
    text.write_bytes((b"ab" * need)[: need - 1])
    code, err = _run_cli([*args, "--corpus", str(text), "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and f"holds {need - 1} bytes" in err
    text.write_bytes((b"ab" * need)[:need])
    assert demo_main([*args, "--corpus", str(text), "--out", str(tmp_path / "b")]) == 0


def test_rejected_run_leaves_no_output_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out is created only once the inputs are valid: a bad corpus leaves nothing behind."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print('hi')\n")
    out = tmp_path / "new" / "out"
    code, err = _run_cli(["--quick", "--corpus", str(tiny), "--out", str(out)], capsys)
    assert code == 2 and "needs at least" in err
    assert not (tmp_path / "new").exists()
    # An --out under a file still fails at once, before the corpus is read.
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, err = _run_cli(["--corpus", str(tiny), "--out", str(a_file / "sub")], capsys)
    assert code == 2 and "cannot write to folder" in err and "needs at least" not in err


def test_tokens_per_s_leaves_out_inspected_steps() -> None:
    """Median over the steps the inspector did not sample; none left: n/a (NaN), never a
    figure that includes inspected steps."""
    r = RunResult("fp8-delayed", "FP8", "", tokens_per_step=100)
    r.step_time = [9.0, 1.0, 8.0, 3.0]
    r.inspected = [True, False, True, False]
    assert r.tokens_per_s == 100 / statistics.median([1.0, 3.0])
    r.inspected = [True] * 4
    assert math.isnan(r.tokens_per_s)


def test_quick_run_tokens_per_s_is_that_of_steps_not_inspected(quick_run: Path) -> None:
    """--quick inspects FP8 delayed scaling on some steps only, and its tokens/s is recomputed
    from metrics.csv's uninspected step times (tokens per step from the uninspected fp32 run)."""
    with open(quick_run / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["step_time_s"]]
    summary = {
        s["variant"]: s for s in json.loads((quick_run / "results.json").read_text())["summary"]
    }

    def times(variant: str, inspected: str) -> list[float]:
        return [
            float(r["step_time_s"])
            for r in rows
            if r["variant"] == variant and r["inspected"] == inspected
        ]

    assert times("fp8-delayed", "1") and not times("fp32", "1")
    tokens_per_step = summary["fp32"]["tokens_per_s"] * statistics.median(times("fp32", "0"))
    expected = tokens_per_step / statistics.median(times("fp8-delayed", "0"))
    assert summary["fp8-delayed"]["tokens_per_s"] == pytest.approx(expected, rel=1e-9)


def test_user_corpus_quick_run_without_fp32(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No fp32 run: every comparison with fp32 says n/a (never "nan"), and the 2% target is
    marked as not checked instead of ticked."""
    text = tmp_path / "poem.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    out = tmp_path / "o"
    args = ["--quick", "--steps", "2", "--variants", "bf16,fp8-current", "--device", "cpu"]
    code = demo_main([*args, "--bf16", "emulated", "--corpus", str(text), "--out", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "FP8 current scaling" in captured.err  # the progress bar
    assert not re.search(r"\bnan", captured.out)
    # val loss, gap, tokens/s, vs fp32, vs bf16 (bf16 emulated: its speed is not a bf16 speed)
    rows = [line.split()[-5:] for line in captured.out.splitlines()[1:3]]
    for val, gap, tokens, vs_fp32, vs_bf16 in rows:
        assert math.isfinite(float(val)) and float(tokens.replace(",", "")) > 0
        assert (gap, vs_fp32, vs_bf16) == ("n/a", "n/a", "n/a")
    report = (out / "report.md").read_text()
    assert "poem.txt" in report and "FP8 current scaling" in report
    assert not re.search(r"\bnan", report)  # Python's spelling of a NaN number
    assert "✅" not in report and "❌" not in report
    assert "**Targets not checked**: no fp32 run to compare with (targets: FP8 final" in report
    assert "- ➖ FP8 current scaling: finished with finite losses" in report
    assert "the 2% gap to fp32 was not checked" in report
    assert "| n/a | n/a |" in report  # speed vs fp32, speed vs bf16 (bf16 emulated)
    assert "fp8_stats.csv" not in report  # lists only the files it wrote
    assert not (out / "fp8_amax_scale.png").exists()  # no delayed-scaling run to inspect
    targets = json.loads((out / "results.json").read_text())["targets"]
    assert [(t["variant"], t["met"]) for t in targets] == [("fp8-current", None)]


def test_quick_has_its_own_default_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quick`` must not overwrite the report of a full run."""
    monkeypatch.chdir(tmp_path)
    assert parse_options(["--quick"], "demo").out == Path("fp8kit-demo-quick")
    assert parse_options([], "demo").out == Path("fp8kit-demo")
    assert parse_options(["--quick", "--out", "mine"], "demo").out == Path("mine")


def test_device_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "o")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_options(out, "demo").device == "cpu"  # auto without CUDA
    assert parse_options(["--device", "cpu", *out], "demo").device == "cpu"
    code, err = _run_cli(["--device", "cuda", *out], capsys)
    assert code == 2
    assert err == (
        "python -m fp8kit.demo: error: --device cuda: CUDA is not available here "
        "(torch.cuda.is_available() is False); use --device cpu or --device auto\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_options(out, "demo").device == "cuda"  # auto picks CUDA when it is there
    assert parse_options(["--device", "cpu", *out], "demo").device == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_run_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert demo_main(["--quick", "--steps", "2", "--device", "cuda", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "- Device: cuda (" in report and "This run trained on" in report
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert all(math.isfinite(s["speed_vs_bf16"]) for s in summary)  # native bf16 on CUDA


def test_percent_axis_reads_tiny_and_zero_values() -> None:
    """Saturation / flush panels: a log axis whose bottom decade, one below the smallest
    non-zero value, is labelled 0; all-zero panels say so instead of drawing a flat line."""
    plt = charts._pyplot()
    fig, (a, b) = plt.subplots(1, 2)
    floor = charts._percent_axis(a, [[0.0, 3e-5, 0.0], [2e-3, 0.0, 0.0]], "saturated")
    assert floor == pytest.approx(1e-6)
    assert a.get_yscale() == "log"
    assert a.get_ylim()[0] < floor < 3e-5 < 2e-3 < a.get_ylim()[1]
    fig.canvas.draw()
    labels = {t.get_text() for t in a.get_yticklabels()}
    assert "0" in labels
    assert charts._percent_axis(b, [[0.0, 0.0], [0.0]], "flushed") is None
    assert [t.get_text() for t in b.texts] == ["no element flushed at any sampled step (0%)"]
    plt.close(fig)


def test_train_lines_of_coinciding_variants_interleave() -> None:
    """Four identical training curves show four colours in turn: same dash, shifted offsets."""
    patterns = [charts._train_dashes(i, 4) for i in range(4)]
    assert {p[1] for p in patterns} == {(4.0, 12.0)}
    assert [p[0] for p in patterns] == [0.0, 4.0, 8.0, 12.0]


def test_console_command_runs_the_demo(tmp_path: Path) -> None:
    """``python -m fp8kit demo`` (what the ``fp8kit`` console script calls) in a subprocess."""
    out = tmp_path / "o"
    args = ["demo", "--quick", "--steps", "1", "--variants", "fp32", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "fp8kit", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.md").is_file() and (out / "loss.png").is_file()
    assert "report:" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "fp8kit", "demo", "--corpus", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("fp8kit demo: error: --corpus")
    assert not (tmp_path / "fp8kit-demo").exists()  # nothing created for a bad corpus


def test_fp8kit_command_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8kit_main(["--version"]) == 0
    assert "fp8kit 0." in capsys.readouterr().out
    assert fp8kit_main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err
    assert fp8kit_main([]) == 2
    assert fp8kit_main(["--help"]) == 0
    for option in ("--version", "-h"):  # extra words were ignored with exit code 0
        capsys.readouterr()
        assert fp8kit_main([option, "extra"]) == 2
        assert f"{option} takes no arguments, got ['extra']" in capsys.readouterr().err


def test_stdlib_corpus_is_deterministic_and_excludes_installed_packages() -> None:
    a = load_corpus(max_bytes=300_000)
    b = load_corpus(max_bytes=300_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.num_bytes == 300_000 and a.val.numel() == 30_000
    root, files = stdlib_files()
    assert files and all("site-packages" not in p.relative_to(root).parts for p in files)
    assert all(p.suffix == ".py" for p in files)


def test_corpus_folder_skips_binary_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("hello world " * 50)
    (tmp_path / "a.bin").write_bytes(b"\x00\x01\x02" * 100)
    corpus = load_corpus(tmp_path, min_bytes=10)
    assert corpus.num_files == 1 and corpus.num_bytes == 600
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty)


def test_batches_and_schedule() -> None:
    a = batch_offsets(1000, 16, 4, 5, seed=3)
    assert torch.equal(a, batch_offsets(1000, 16, 4, 5, seed=3))
    assert a.shape == (5, 4) and int(a.max()) < 1000 - 17
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)


def test_bf16_emulation_rounds_like_bf16_matmul() -> None:
    """Forward: bf16 operands, float32 accumulation, bf16 result; backward rounded likewise."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with Bf16Emulation():
        y = torch.nn.functional.linear(x, w)
    xr, wr = x.detach().bfloat16().float(), w.detach().bfloat16().float()
    expected = (xr.double() @ wr.double().T).bfloat16().float()
    # At most one bf16 step apart (float32 vs float64 accumulation before the last rounding).
    assert ((y.detach() - expected).abs() <= expected.abs() * 2**-7).all()
    assert torch.equal(y.detach(), y.detach().bfloat16().float())  # bf16-valued
    g = torch.randn(8, 16)
    y.backward(g)
    assert torch.equal(x.grad, x.grad.bfloat16().float())
    gr = g.bfloat16().float()
    dx = (gr @ wr).bfloat16().float()
    assert (x.grad - dx).abs().max() <= dx.abs().max() * 2**-7
    # Native bf16 autocast gives the same numbers up to accumulation order.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = torch.nn.functional.linear(x.detach(), w.detach()).float()
    assert (native - y.detach()).abs().max() <= native.abs().max() * 2**-7


def test_missing_matplotlib_is_reported_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    code, err = _run_cli(["--quick", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "pip install 'fp8kit[demo]'" in err and err.count("\n") == 1


def _run_info(
    device: str, load_start: float, load_end: float, cores: int = 2, threads: int = 1
) -> RunInfo:
    machine = {
        "cpu_count": cores,
        "load_average_at_start": (load_start, 0.0, 0.0),
        "cpu_bf16_units": ["AMX-BF16"],
        "gpu": "Some GPU" if device == "cuda" else None,
    }
    info = RunInfo(MODEL, TrainConfig(), 1, "text", 1, 1, {}, "", "", "", machine, device=device)
    info.load_after = (load_end, 0.0, 0.0)
    info.threads = threads
    return info


def test_speed_note_explains_the_device_and_flags_a_busy_machine() -> None:
    idle = "\n".join(speed_note(_run_info("cpu", 0.1, 0.3)))
    assert idle.startswith("This run trained on the CPU, where no FP8 arithmetic exists")
    assert "this CPU: AMX-BF16" in idle and idle.endswith("docs/benchmarks.md.")
    assert "busy" not in idle
    busy = speed_note(_run_info("cpu", 0.1, 2.5))  # others' load above half the cores at the end
    assert busy[0].startswith("This machine was busy during the run")
    # The run's own two threads on an idle 2-core machine are not "other processes".
    assert "busy" not in "\n".join(speed_note(_run_info("cpu", 0.2, 1.9, threads=2)))
    assert speed_note(_run_info("cpu", 0.2, 3.1, threads=2))[0].startswith("This machine was busy")
    assert speed_note(_run_info("cpu", 1.5, 0.0))[0].startswith("This machine was busy")
    # On a GPU the run's CPU threads sit idle: only its driving thread is its own load.
    assert machine_was_busy(_run_info("cuda", 0.2, 12.0, cores=16, threads=16))
    assert not machine_was_busy(_run_info("cuda", 0.2, 1.0, cores=16, threads=16))
    assert busy[0].endswith("not comparable between variants.") and busy[1] == ""
    gpu = "\n".join(speed_note(_run_info("cuda", 0.0, 0.0)))
    assert gpu.startswith("This run trained on Some GPU.")
    assert "1024 tokens through GEMMs 128 to 512 wide" in gpu
    assert gpu.endswith("docs/benchmarks.md.")


def test_evaluation_leaves_the_fp8_scaling_state_of_the_training_alone() -> None:
    """Validation windows run under no_grad in the variant's FP8 autocast; fp8kit (as TE) stages
    such a pass's amaxes for the next training step's event, so the demo puts them back: the
    validation data never moves the training scales."""
    torch.manual_seed(0)
    variant = make_variant("fp8-delayed")
    model = GPT(QUICK_MODEL)
    x = torch.randint(0, 256, (2, QUICK_MODEL.block_size))
    with variant.context():  # one training step, so the state is bound and non-trivial
        model(x, x).backward()
    before = {n: m.state_dict() for n, m in fp8_metas(model)}
    assert before, "the FP8 variant's model has FP8 modules"
    val = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    loss = _evaluate(model, variant, val, TrainConfig(eval_windows=4, batch_size=2))
    assert math.isfinite(loss)
    for name, meta in fp8_metas(model):
        for key, value in meta.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, before[name][key]), (name, key)


def test_a_run_writes_only_its_listed_files_and_a_new_run_clears_them(
    quick_run: Path, tmp_path: Path
) -> None:
    """A re-run into the same folder (say with fewer variants) left the earlier run's FP8
    charts and statistics beside its new report; a new run removes every file a run may write
    (OUTPUT_FILES, which lists all of them) and nothing else."""
    assert {p.name for p in quick_run.iterdir()} <= set(OUTPUT_FILES)
    out = tmp_path / "out"
    out.mkdir()
    for name in (*OUTPUT_FILES, "notes.txt"):
        (out / name).write_text("an earlier run")
    args = ["--quick", "--steps", "1", "--variants", "fp32", "--device", "cpu", "--out", str(out)]
    assert demo_main(args) == 0
    left = {p.name for p in out.iterdir()}
    assert "notes.txt" in left and "fp8_stats.csv" not in left and "fp8_amax_scale.png" not in left
    assert (out / "report.md").read_text() != "an earlier run"
