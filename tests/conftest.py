"""Settings of the test process, before any test module imports torch, and the two lanes.

One intra-op thread per process, and per subprocess the tests start (torchrun ranks, entry
points): the suite's tensors are small, so an OpenMP team only adds wake-ups, and on a shared
2-core machine its threads spin against the forked ranks and each other; one step of the small
test model took ten times longer with two threads under load than with one. Tests check
numbers, never timing; a test that needs more threads sets them itself
(``test_host_adamw_threads.py``).

Lanes: ``-m "not slow"`` is the fast lane, single-process tests of each piece; every test of
several processes (marked ``distributed``: forked gloo ranks, torchrun) and every end-to-end run
of an entry point or a ``--plan_for`` search is ``slow`` too, in the whole suite only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's FX graph cache keys a CPU graph without the ATen capability the process runs
# under: a graph compiled at the machine's own ISA and read back under ATEN_CPU_CAPABILITY=avx2
# gave NaN losses, and crashed the numerics lane once (torch 2.13 here). So each capability
# the lanes run under compiles into a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    capability = os.environ["ATEN_CPU_CAPABILITY"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"torchinductor_{os.getuid()}_{capability}"
    )

import torch  # after the variable, which OpenMP reads once

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module whose tensors are tiles (initial weights), whatever an
    earlier module set: on a shared machine a team of threads mostly waits for itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The modules whose tolerances rest on float32 arithmetic against an independent reference:
# CI runs their fast tests again under other CPU kernels (ATEN_CPU_CAPABILITY,
# MKL_ENABLE_INSTRUCTIONS), so a tolerance that holds on one instruction set only fails there.
# Each by its path under tests/ (its wing's folder and its name).
NUMERICS = frozenset(
    {
        "engine/test_attention_dropout.py",
        "engine/test_host_adamw_threads.py",
        "engine/test_late_streams.py",
        "engine/test_optimizer_and_metrics.py",
        "engine/test_optimizer_threaded.py",
        "engine/test_passes_and_placement.py",
        "engine/test_phased_equivalence.py",
        "engine/test_phases.py",
        "engine/test_recompute.py",
        "engine/test_update.py",
        "finetuning/test_finetuning_parity.py",
        "modelling/test_hf_llama31.py",
        "modelling/test_hf_parity.py",
        "modelling/test_initialisation.py",
        "modelling/test_weight_drawing.py",
        "parallel/test_overlap.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Multi-process tests belong to the slow lane; :data:`NUMERICS` modules are marked.

    Under pytest-xdist (``-n 2 --dist loadgroup``, the README's command) each module's tests
    run in one worker, so a module's fixtures are made once; the tests of the session's quick
    first run (two modules) share a worker, which runs it once (46 s)."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
        module = "/".join(item.path.parts[-2:])  # wing/test_x.py
        if module in NUMERICS:
            item.add_marker(pytest.mark.numerics)
        shared = "quick_first_run" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("quick_first_run" if shared else module))


@pytest.fixture(scope="session")
def quick_first_run(tmp_path_factory) -> tuple[object, dict, Path]:
    """``benchmarks/gpu_first_run.py --device cpu --quick`` run once, as a new process with
    the packages the lent GPU machines lack blocked (``tests/fixtures/blocked_imports`` first
    on its PYTHONPATH, which its stages inherit): its result, its report and its calibration's
    spec file, which is ``calibrate.py --quick``'s output
    (``tests/benchmarks/test_gpu_first_run.py`` checks the run,
    ``tests/planning/test_calibrate.py`` the calibration and estimates on it)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    blocked = root / "tests" / "fixtures" / "blocked_imports"
    path = os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))
    out = tmp_path_factory.mktemp("first_run") / "first.json"
    command = [sys.executable, "-m", "benchmarks.gpu_first_run", "--device", "cpu", "--quick"]
    result = subprocess.run(
        [*command, "--json", str(out)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads(out.read_text()), out.with_suffix(".spec.json")
