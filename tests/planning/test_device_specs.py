"""--device_spec_file: measured numbers replace the data sheet's, in the spec and in the dry run."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from config.loading import ConfigError, parse_config
from execution.planning.device_specs import (
    FIELD_RULES,
    SPECS,
    DeviceSpec,
    read_spec_file,
    spec_file_dict,
)
from execution.planning.dry_run import estimate, measure_rank
from execution.planning.run_shape import RunShape

TINY = ["--config", "tiny", "--device", "cpu"]


def write_spec(tmp_path, **fields) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"device_spec": fields, "measurements": {"ignored": 1}}))
    return str(path)


def test_file_fields_replace_the_data_sheet_and_flags_still_win(tmp_path):
    measured = dict(
        name="calibrated",
        peak_tflops=500.0,
        compute_efficiency=0.5,
        h2d_gb_per_s=40.0,
        matmul_tflops=[[8192, 2048, 2048, 250.0], [64, 64, 64, 1.5]],
    )
    path = write_spec(tmp_path, **measured)
    config, _ = parse_config([*TINY, "--device_spec_file", path, "--host_link_gb_per_s", "33"])
    spec = RunShape.of(config).spec
    h100 = SPECS["h100_sxm"]
    assert (spec.name, spec.peak_tflops, spec.compute_efficiency) == ("calibrated", 500.0, 0.5)
    assert spec.h2d_gb_per_s == 40.0 and spec.host_link_gb_per_s == 33.0  # the flag on top
    assert spec.memory_gb == h100.memory_gb and spec.intra_node_gb_per_s == h100.intra_node_gb_per_s
    # A measured shape answers for itself; others are weighted towards the shapes nearest in
    # each dimension (by hand: 1 / distance^2 on the sum of log ratios, averaged per FLOP);
    # without a table, the data sheet's rate.
    assert spec.matmul_rate(8192, 2048, 2048) == 250.0 and spec.matmul_rate(64, 64, 64) == 1.5
    near, far = math.log(2), math.log(256) + 2 * math.log(32)
    weights = (1 / near**2, 1 / far**2)
    by_hand = sum(weights) / (weights[0] / 1.5 + weights[1] / 250.0)
    assert spec.matmul_rate(32, 64, 64) == pytest.approx(by_hand, rel=1e-12)
    assert spec.matmul_rate(8000, 2048, 2048) == pytest.approx(250.0, rel=0.01)
    assert h100.matmul_rate(1, 1, 1) == pytest.approx(989.0 * 0.7)
    # What a calibration writes reads back to the same spec.
    again = write_spec(tmp_path, **spec_file_dict(spec))
    assert read_spec_file(again, h100) == spec


def test_a_missing_or_wrong_file_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_config([*TINY, "--device_spec_file", str(tmp_path / "absent.json")])
    with pytest.raises(ConfigError, match="unknown fields peak_tflop"):
        read_spec_file(write_spec(tmp_path, peak_tflop=1.0), SPECS["h100_sxm"])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a calibration file"):
        read_spec_file(tmp_path / "bad.json", SPECS["h100_sxm"])


def test_the_dry_run_estimates_with_the_measured_rate(tmp_path):
    """Matmul time is FLOPs at peak x efficiency where the FLOPs outlast the bytes (here a
    bandwidth without bound): a file that halves the rate doubles it. (Attention at the matmul
    rate here: its own rate is tested in test_attention_dropout.)"""
    config, _ = parse_config([*TINY, "--dry_run"])
    run = RunShape.of(config)
    unbound = {"attention_efficiency": 0.0, "device_memory_gb_per_s": 1e12}
    sheet = dataclasses.replace(run.spec, **unbound)
    path = write_spec(tmp_path, peak_tflops=sheet.peak_tflops / 2, **unbound)
    measured_config = dataclasses.replace(
        config, planning=dataclasses.replace(config.planning, device_spec_file=path)
    )
    measured_run = RunShape.of(measured_config)
    measured = measured_run.spec
    m = measure_rank(run, 0, sheet)
    by_sheet = estimate(run, m, sheet)
    by_file = estimate(measured_run, measure_rank(measured_run, 0, measured), measured)
    expected = m.flops / (sheet.peak_tflops / 2 * 1e12 * sheet.compute_efficiency)
    assert by_file["compute_s"] == pytest.approx(expected)
    assert by_file["compute_s"] == pytest.approx(2 * by_sheet["compute_s"])


def test_every_field_a_spec_file_can_name_has_a_rule():
    assert set(FIELD_RULES) == {f.name for f in dataclasses.fields(DeviceSpec)}


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("peak_tflops", 0, "a finite number > 0"),  # divided by: was a ZeroDivisionError
        ("host_link_gb_per_s", -55.0, "a finite number > 0"),
        ("device_memory_gb_per_s", math.nan, "a finite number > 0"),
        ("host_memory_gb_per_s", math.inf, "a finite number > 0"),
        ("memory_gb", True, "a finite number > 0"),  # JSON's true is no number of GiB
        ("compute_efficiency", 1.5, r"a number in \(0, 1\]"),
        ("compute_efficiency", 0.0, r"a number in \(0, 1\]"),
        ("attention_efficiency", -0.1, r"a number in \[0, 1\] \(0: as compute_efficiency\)"),
        ("devices_per_node", 2.5, "an integer >= 1"),
        ("launch_overhead_us", -1.0, "a finite number >= 0"),
        ("host_adamw_elements_per_s", -1.0, r"a finite number >= 0 \(0: not measured\)"),
        ("waited_collective_us", math.nan, "null"),
        ("matmul_tflops", [[64, 64, 64, 1.5], [64, 64, 0, 2.0]], r"a list of \[m, n, k, TFLOPS\]"),
        ("collective_gb_per_s", [["all_reduce", 4096, 0.0]], r"a list of \[op, bytes, GB/s\]"),
        ("device_type", "tpu", '"cuda" or "cpu"'),
        ("copies_overlap", "yes", "true or false"),
        (
            "host_phase_us",
            [[False, "full", False, "layer_forward", 100.0, -5.0, 0.0, 30.0]],
            r"a list of \[compiled, recompute, dropout, kind",
        ),
        (
            "host_phase_us",
            [[False, "some", False, "layer_forward", 100.0, 5.0, 0.0, 30.0]],
            r"a list of \[compiled, recompute, dropout, kind",
        ),
    ],
)
def test_a_value_out_of_range_is_one_config_error_naming_field_and_range(
    tmp_path, field, value, allowed
):
    """NaN and infinity reach the file as JSON's NaN and Infinity, which json reads back."""
    path = write_spec(tmp_path, **{field: value})
    with pytest.raises(ConfigError, match=f"{field} is .*; it must be {allowed}") as raised:
        read_spec_file(path, SPECS["h100_sxm"])
    assert "\n" not in str(raised.value)
    config, _ = parse_config([*TINY, "--dry_run", "--device_spec_file", path])
    with pytest.raises(ConfigError, match=f"it must be {allowed}"):  # what a dry run plans on
        RunShape.of(config)


def test_not_measured_may_be_zero_or_null(tmp_path):
    unmeasured = dict(
        h2d_gb_per_s=0,
        d2h_gb_per_s=0.0,
        attention_efficiency=0.0,
        launch_overhead_us=0.0,
        phase_overhead_us=0,
        waited_collective_us=None,
        fresh_memory_gb_per_s=0.0,
        fresh_memory_threshold=0,
        random_draw_ns=0.0,
        host_adamw_elements_per_s=0.0,
        matmul_tflops=[],
        collective_gb_per_s=[],
    )
    spec = read_spec_file(write_spec(tmp_path, **unmeasured), SPECS["h100_sxm"])
    assert spec.host_adamw_elements_per_s == 0.0 and spec.waited_collective_us is None
    # Every shipped spec passes its own rules, as a calibration file of it.
    for sheet in SPECS.values():
        assert read_spec_file(write_spec(tmp_path, **spec_file_dict(sheet)), sheet) == sheet


def test_ranks_on_one_host_share_its_memory(tmp_path):
    """On a CPU each of a run's ranks on the host streams memory at most at the host's rate
    with every core streaming over the ranks there (as many as the run's, at most a node's):
    one thread alone 39 GB/s and the host 45 GB/s give 39 to one rank and 22.5 to each of
    two; a GPU's spec, or one without the host's rate, keeps its own. The dry run's memory-
    bound time follows: the same bytes at 22.5 where a lone rank had 39."""
    cpu = dataclasses.replace(SPECS["h100_sxm"], device_type="cpu", device_memory_gb_per_s=39.0)
    cpu = dataclasses.replace(cpu, host_memory_gb_per_s=39.0, shared_memory_gb_per_s=45.0)
    assert cpu.memory_rate(39.0) == 39.0  # one rank on the host
    pair = dataclasses.replace(cpu, ranks_on_host=2)
    assert pair.memory_rate(39.0) == 22.5
    assert dataclasses.replace(pair, shared_memory_gb_per_s=0.0).memory_rate(39.0) == 39.0
    gpu = dataclasses.replace(pair, device_type="cuda")
    assert gpu.memory_rate(3000.0) == 3000.0

    path = write_spec(tmp_path, **{k: v for k, v in spec_file_dict(cpu).items() if k != "name"})
    flags = [*TINY, "--device_spec_file", path, "--dry_run"]
    alone = RunShape.of(parse_config(flags)[0])
    two = RunShape.of(parse_config([*flags, "--data_parallel", "2"])[0])
    assert (alone.spec.ranks_on_host, two.spec.ranks_on_host) == (1, 2)
    # A layout the planner weighs counts its own ranks, at most a node's.
    wide = dataclasses.replace(two.mesh, dp=16)
    assert alone.with_layout(wide, 1).spec.ranks_on_host == cpu.devices_per_node == 8
    costs = estimate(alone, measure_rank(alone, 0, alone.spec), alone.spec)
    shared = dataclasses.replace(alone.spec, ranks_on_host=2)
    costs_shared = estimate(alone, measure_rank(alone, 0, shared), shared)
    assert costs_shared["memory_bound_s"] == pytest.approx(costs["memory_bound_s"] * 39 / 22.5)
