"""benchmarks/calibrate.py on a CPU: its spec file follows from its own raw measurements, which
the dry run reads. How well the dry run's step time on such a spec holds against measured steps
is a timing, so benchmarks/time_model_check.py measures it and prints a table; a test here
compared one step with a factor of 2 either way, and on a loaded machine measured 0.15."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from config.schema import OptimizerConfig
from execution.engine.update.optimizer import AdamWDriver
from execution.planning.calibration import attention, calibrate, kernels, runtime
from execution.planning.device_specs import SPECS, read_spec_file
from tests.entry_points import run_script
from utils.sample_clock import doubtful_timings, load_warning

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_calibration(quick_first_run):
    """The quick calibration of this CPU that the GPU first-run script made (``calibrate.py
    --device cpu --quick``, one thread like this process: tests/conftest.py), and its file."""
    _, _, spec_file = quick_first_run
    return json.loads(spec_file.read_text()), spec_file


@pytest.mark.parametrize(
    ("output", "words"),
    [("missing/spec.json", "its folder {tmp}/missing does not exist"), (".", "is a folder")],
)
def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, output, words):
    """The file is written after minutes of measuring: its path is checked first."""
    result = run_script(
        "-m",
        "benchmarks.calibrate",
        "--device",
        "cpu",
        "--quick",
        "--output",
        str(tmp_path / output),
    )
    assert result.returncode == 2 and result.stdout == ""  # no measurement ran
    assert result.stderr.startswith(f"benchmarks.calibrate: error: --output {tmp_path / output}")
    assert words.format(tmp=tmp_path) in result.stderr and result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_quick_cpu_calibration_writes_a_spec_the_dry_run_reads(quick_calibration):
    result, out = quick_calibration
    base = SPECS[result["base"]]
    spec = read_spec_file(out, base)
    measured = result["measurements"]
    shapes = measured["matmul"]["shapes"]
    # Every shape of the plan was timed, and its rate is its FLOPs over its time.
    expected = [(m, n, k) for _, m, n, k in kernels.matmul_shapes(calibrate.QUICK)]
    assert [(s["m"], s["n"], s["k"]) for s in shapes] == expected
    for (m, n, k, tflops), s in zip(spec.matmul_tflops, shapes, strict=True):
        assert (m, n, k) == (s["m"], s["n"], s["k"])
        assert tflops == pytest.approx(2 * m * n * k / s["seconds"] / 1e12)
    # A CPU has no data sheet: the best rate is the peak, and the GPT shapes' efficiency is
    # their FLOPs over their time against it.
    assert spec.peak_tflops == max(e[3] for e in spec.matmul_tflops)
    gpt = [s for s in shapes if s["kind"] not in ("square", "grid")]
    flops = sum(2 * s["m"] * s["n"] * s["k"] for s in gpt)
    rate = flops / sum(s["seconds"] for s in gpt) / 1e12
    assert spec.compute_efficiency == pytest.approx(rate / spec.peak_tflops)
    # No link on a CPU: host memory stands in for it; copies move 2 bytes per byte copied,
    # the median of three passes apart in time.
    memory = measured["memory"]
    assert spec.device_memory_gb_per_s == pytest.approx(
        2 * memory["bytes"] / memory["seconds"] / 1e9
    )
    fields = (
        ("memory", "device_memory_gb_per_s"),
        ("host_memory", "host_memory_gb_per_s"),
        ("shared_memory", "shared_memory_gb_per_s"),  # every core: what the ranks share
    )
    for name, field in fields:
        rates = measured[name]["passes_gb_per_s"]
        assert len(rates) == 3 and getattr(spec, field) == sorted(rates)[1] > 0
    assert set(measured["host_link"]) == {"others_share"}  # nothing measured, only the load
    assert spec.h2d_gb_per_s == spec.host_link_gb_per_s == spec.host_memory_gb_per_s > 0
    # Memory free to use and the host AdamW's rate, as measured (their own tests below).
    assert spec.memory_gb == spec.host_memory_gb == measured["free_memory"]["host_gib"] > 0
    assert spec.host_adamw_elements_per_s == measured["host_adamw"]["elements_per_s"] > 0
    assert spec.launch_overhead_us > 0
    # What the measurements do not cover stays the base entry's.
    assert spec.inter_node_gb_per_s == base.inter_node_gb_per_s
    assert spec.storage_gb_per_s == base.storage_gb_per_s
    assert spec.name == "calibrated cpu"
    # A CPU's copies and collectives take the cores that compute; its attention is its own.
    assert spec.device_type == "cpu" and not spec.copies_overlap
    assert 0 < spec.attention_efficiency <= 1
    ops = {op for op, _, rate in spec.collective_gb_per_s if rate > 0}
    assert ops == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send"}
    # The host's own time per kind of phase (the quick calibration's one way: eager, full
    # recompute, no dropout): every kind of the step, each row the measurement less its
    # kernels' time as the spec prices them (a CPU runs them as it launches them), and the
    # kernels the dry run counts for them.
    (run,) = measured["host_phases"]["runs"]
    assert (run["compiled"], run["recompute"], run["dropout"]) == (False, "full", 0.0)
    kinds = ("embedding_forward", "layer_forward", "head", "layer_backward")
    assert set(kinds) | {"embedding_backward", "optimizer"} == set(run["kinds"])
    rows = {row[3]: row for row in spec.host_phase_us}
    for kind, m in run["kinds"].items():
        assert rows[kind][:3] == (False, "full", False)
        assert rows[kind][4:] == pytest.approx(
            (m["per_phase_us"], m["per_unit_us"], m["kernels_per_phase"], m["kernels_per_unit"])
        )
    for kind in kinds:  # each micro-batch launches kernels and takes the host's time
        assert rows[kind][5] > 0 and rows[kind][7] >= 1
    assert spec.phase_overhead_us == 0  # none left beside the rows
    # Waiting for a collective inside a step: two ranks' steps at tensor-parallel 2, the larger
    # model waiting for more calls; the cost per call is the fit through them, each residual
    # over the modelled step relative to its step, by hand.
    rows = measured["waited_collectives"]["rows"]
    assert [(r["layers"], r["micro_batches"]) for r in rows] == [(1, 2), (3, 2)]
    assert 0 < rows[0]["waited_calls"] < rows[1]["waited_calls"]
    excess = [(r["step_s"] - r["modelled_s"], r["waited_calls"], r["step_s"]) for r in rows]
    fit = sum(e * n / t**2 for e, n, t in excess) / sum(n * n / t**2 for _, n, t in excess)
    assert spec.waited_collective_us == pytest.approx(max(fit, 0.0) * 1e6)


CPU = torch.device("cpu")
GiB = 2**30


def test_the_timed_host_update_is_the_engine_s_adamw_piece_by_piece(monkeypatch):
    """What measure_host_adamw times: the engine's own AdamWDriver.update on a one-row state
    in pieces of the staging size (shrunk here to 1000 elements: 2500 make three pieces),
    refreshing a bfloat16 weight copy after each. Against torch.optim.AdamW on the same
    numbers: the same elementwise arithmetic, so float32 rounding only (rtol 1e-6 is several
    ulps at these magnitudes, as test_optimizer_and_metrics compares adamw_)."""
    monkeypatch.setattr(runtime, "STAGING_ELEMENTS", 1000)
    n, lr = 2500, 1e-2
    generator = torch.Generator().manual_seed(0)
    weights, grads = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    tensors = [weights.clone(), grads.clone(), torch.zeros(n), torch.zeros(n)]
    copy = torch.zeros(n, dtype=torch.bfloat16)
    state = runtime.HostUpdateState(tensors, copy)
    pieces = [piece for *_, piece, _ in state.host_update_pieces()]
    assert pieces == [slice(0, 1000), slice(1000, 2000), slice(2000, 2500)]
    optim = OptimizerConfig()
    AdamWDriver(state, optim, host_threads=2).update(lr=lr, grad_scale=0.5)
    reference = torch.nn.Parameter(weights.clone())
    betas = (optim.beta1, optim.beta2)
    wd = optim.weight_decay
    torch_adamw = torch.optim.AdamW(
        [reference], lr=lr, betas=betas, eps=optim.eps, weight_decay=wd, foreach=False
    )
    reference.grad = grads * 0.5  # a power of two: exact
    torch_adamw.step()
    torch.testing.assert_close(tensors[0], reference.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(copy, tensors[0].to(torch.bfloat16))


def test_the_host_adamw_rate_is_its_elements_over_the_update_s_time():
    """A small update (3 chunks of 64 Ki), on the threads of a rank of this process's (one,
    tests/conftest.py), with no weight copy on a CPU (a float32 run keeps none)."""
    sizes = dataclasses.replace(calibrate.QUICK, adamw_elements=3 << 16, repeats=2)
    measured = runtime.measure_host_adamw(CPU, sizes)
    assert measured["elements"] == 3 << 16 and measured["threads"] == torch.get_num_threads()
    assert measured["weight_copy"] is None
    assert measured["elements_per_s"] == pytest.approx(measured["elements"] / measured["seconds"])


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":")
        if name == key:
            return int(value.split()[0]) * 1024  # kB
    raise KeyError(key)


def test_a_memory_rate_is_its_middle_pass_and_passes_apart_are_counted_in_the_load_warning():
    """median_pass on passes made up by hand: the middle rate whichever order the passes
    came in; passes 60% apart (two cores of this VM, minutes apart) make the rate doubtful,
    and the calibration's load warning names it; passes within 25% (an idle
    calibration's differ by up to 16%) do not."""

    def one(rate: float, trusted: bool = True) -> dict:
        timing = {"samples": 9, "spoiled": 0, "spread": 0.01, "trusted": trusted, "together": False}
        return {"bytes": 10**9, "seconds": 2 / rate, "gb_per_s": rate, "timing": timing}

    apart = kernels.median_pass([one(67.8), one(42.4), one(43.0)])
    assert apart["gb_per_s"] == 43.0 and apart["seconds"] == 2 / 43.0
    assert apart["passes_gb_per_s"] == [67.8, 42.4, 43.0]
    assert apart["timing"]["spread"] == pytest.approx(67.8 / 42.4 - 1)
    close = kernels.median_pass([one(33.0), one(35.0), one(34.0)])
    assert close["gb_per_s"] == 34.0 and close["timing"]["trusted"]
    assert not apart["timing"]["trusted"]
    # A pass whose own samples were spoiled spoils the rate, however close the passes.
    assert not kernels.median_pass([one(33.0), one(35.0, trusted=False), one(34.0)])["timing"][
        "trusted"
    ]
    for memory, warned in ((apart, True), (close, False)):
        doubtful = doubtful_timings({"memory": memory | {"others_share": 0.0}})
        result = {"doubtful_timings": doubtful, "measurements": {"memory": memory}}
        warning = load_warning(result)
        assert (warning is not None) == warned
        assert not warned or "1 of 1 timings of memory" in warning


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux's /proc/meminfo")
def test_free_memory_is_what_the_host_has_available_not_its_installed_pages():
    """On a CPU the device is the host, one pool: MemAvailable, read before and after the
    measurement by hand here. Other workers on the machine may allocate in the microseconds
    between the reads: 1% of the installed memory (hundreds of MiB) allows for that."""
    before = _meminfo_bytes("MemAvailable")
    measured = kernels.measure_free_memory(CPU, calibrate.QUICK)
    after = _meminfo_bytes("MemAvailable")
    installed = _meminfo_bytes("MemTotal")
    available = measured["host_gib"] * GiB
    assert measured["device_gib"] == measured["host_gib"]
    slack = 0.01 * installed
    assert min(before, after) - slack <= available <= max(before, after) + slack
    assert available < installed


def test_spec_fields_take_free_memory_the_update_rate_and_the_link_as_both_ways_share_it():
    """spec_fields on measurements made up by hand. A draw's time beyond its bytes' is its
    ``random_draw_ns`` (0 where the bytes take longer). Without a link (a CPU) host memory
    stands in for it. With one: each direction's rate is the one it had while the other ran (1 GB
    each way in 40 ms: 25 GB/s), and the one rate the time model prices loads and stores
    together at is the slowest of each direction alone (50 and 45 GB/s) and both at once
    (2 GB in 40 ms: 50 GB/s): 45 GB/s; were both at once slower (2 GB in 50 ms: 40 GB/s),
    that."""
    measured = {
        "free_memory": {"device_gib": 70.5, "host_gib": 100.25},
        "matmul": {"shapes": [{"kind": "qkv", "m": 8, "n": 8, "k": 8, "seconds": 1e-3}]},
        "memory": {"gb_per_s": 20.0},
        "host_memory": {"gb_per_s": 12.0},
        "host_link": {},
        "launch": {"overhead_us": 3.0},
        "attention": {"tflops": 1e-7, "shape": [1, 2, 64, 32]},
        "attention_kernels": {"cases": []},
        "collectives": {"rates": []},
        "fresh_memory": {"gb_per_s": 0.0, "threshold": 0},
        # 4 MB written in 5 ms: 0.2 ms of it the bytes' at 20 GB/s, 4.8 ns beyond a number.
        "random": {"elements": 10**6, "bytes": 4 * 10**6, "seconds": 5e-3},
        "host_adamw": {"elements_per_s": 3.5e8},
        "shared_memory": {"gb_per_s": 30.0},
    }
    measured["matmul"]["shapes"][0]["tflops"] = 2 * 8**3 / 1e-3 / 1e12
    assert runtime.measure_host_link(CPU, calibrate.QUICK) == {}
    fields = calibrate.spec_fields(measured, CPU)
    assert (fields["memory_gb"], fields["host_memory_gb"]) == (70.5, 100.25)
    assert fields["host_adamw_elements_per_s"] == 3.5e8
    assert fields["shared_memory_gb_per_s"] == 30.0
    assert fields["random_draw_ns"] == pytest.approx(4.8)
    keeping_up = measured | {"random": {"elements": 10**6, "bytes": 4 * 10**6, "seconds": 1e-4}}
    assert calibrate.spec_fields(keeping_up, CPU)["random_draw_ns"] == 0.0
    assert fields["h2d_gb_per_s"] == fields["d2h_gb_per_s"] == fields["host_link_gb_per_s"] == 12.0

    def link(both_seconds: float) -> dict:
        return {
            "h2d_alone_gb_per_s": 50.0,
            "d2h_alone_gb_per_s": 45.0,
            "h2d_gb_per_s": 1.0 / 0.04,
            "d2h_gb_per_s": 1.0 / 0.04,
            "both_gb_per_s": 2.0 / both_seconds,
        }

    fields = calibrate.spec_fields(measured | {"host_link": link(0.04)}, CPU)
    assert fields["h2d_gb_per_s"] == fields["d2h_gb_per_s"] == pytest.approx(25.0)
    assert fields["host_link_gb_per_s"] == pytest.approx(45.0)
    fields = calibrate.spec_fields(measured | {"host_link": link(0.05)}, CPU)
    assert fields["host_link_gb_per_s"] == pytest.approx(40.0)


def test_spec_fields_take_each_attention_kernel_s_timing_and_the_fastest_s_rate():
    """The kernels' cases that ran become the spec's timings (one that raised is left out);
    attention_efficiency is the fastest kernel's without dropout at the pinned kernel's shape
    where it beats the pinned one (300 TFLOPS of a 1000 peak), not a faster one with dropout
    or at another shape."""
    shape = [4, 16, 2048, 128]
    cases = [
        {"kernel": "flash", "shape": shape, "dtype": "bfloat16", "dropout": 0.0},
        {"kernel": "cudnn", "shape": shape, "dtype": "bfloat16", "dropout": 0.0},
        {"kernel": "cudnn", "shape": shape, "dtype": "bfloat16", "dropout": 0.1},
        {"kernel": "flash", "shape": shape, "dtype": "bfloat16", "dropout": 0.1},
        {"kernel": "flash", "shape": [1, 32, 2048, 128], "dtype": "bfloat16", "dropout": 0.0},
    ]
    timed = [(2e-3, 200.0), (1.5e-3, 300.0), None, (1e-3, 400.0), (1e-3, 500.0)]
    for case, ran in zip(cases, timed, strict=True):
        case.update({"seconds": ran[0], "tflops": ran[1]} if ran else {"error": "RuntimeError"})
    measured = {"cases": cases}
    assert attention.kernel_timings(measured) == [
        ["flash", *shape, "bfloat16", 0.0, 2e-3],
        ["cudnn", *shape, "bfloat16", 0.0, 1.5e-3],
        ["flash", *shape, "bfloat16", 0.1, 1e-3],
        ["flash", 1, 32, 2048, 128, "bfloat16", 0.0, 1e-3],
    ]
    assert attention.fastest_tflops(measured, shape) == 300.0
    assert attention.fastest_tflops(measured, [2, 2, 2, 2]) is None
    # Two matmuls of 2 x 4 x 4 x 2 FLOPs forward, 2.5 times that backward, half of it causal.
    assert attention.causal_attention_flops((1, 1, 4, 2)) == (128 + 320) // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's host link")
def test_the_host_link_is_timed_on_registered_pages_each_way_alone_and_both_at_once():
    """On a GPU only (the suite's CPU runs import and parse it): both directions at once move
    twice the bytes in their time, and no direction runs faster beside the other than alone
    by more than timing noise (10%)."""
    sizes = dataclasses.replace(calibrate.QUICK, link_bytes=64 * 2**20, repeats=5)
    link = runtime.measure_host_link(torch.device("cuda", 0), sizes)
    assert link["both_gb_per_s"] == pytest.approx(2 * link["h2d_gb_per_s"])
    assert link["h2d_gb_per_s"] <= 1.1 * link["h2d_alone_gb_per_s"]
    assert link["d2h_gb_per_s"] <= 1.1 * link["d2h_alone_gb_per_s"]
