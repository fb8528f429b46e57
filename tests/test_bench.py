"""The benchmark's code path, in its smallest configuration: every figure reaches results.json.

Figures are only checked for being there and being numbers; timings are never asserted on.
"""

import json
import math
import sys

from .conftest import TEMPLATE

sys.path.insert(0, str(TEMPLATE / "bench"))

import benchmark  # noqa: E402


def test_a_minimal_benchmark_run_writes_every_figure(default_project, real_mnist, tmp_path):
    benchmark.main(
        ["--out", str(tmp_path), "--project", str(default_project), "--data-dir", str(real_mnist),
         "--repeats", "1", "--warmup", "1", "--steps", "2", "--loader-seconds", "0.2", "--accelerator", "cpu",
         "--glibc-malloc-defaults"]
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())

    def assert_figure(value) -> None:
        assert isinstance(value, float) and math.isfinite(value), value

    assert set(results["throughput"]) == {"1 process", "2 processes (DDP)", "1 process, glibc malloc defaults"}
    for case in results["throughput"].values():
        for name in ("template_images_per_s", "reference_images_per_s", "template_vs_reference",
                     "template_vs_reference_median_step", "template_vs_reference_cpu_time",
                     "template_overhead_ms_per_step"):  # fmt: skip
            assert_figure(case[name])
        assert all(faults >= 0 for faults in case["page_faults_per_step"].values())
    for name in ("template_s", "reference_s", "import_floor_s", "template_over_floor_s"):
        assert_figure(results["startup"][name])
    for name in ("loader_images_per_s", "training_images_per_s", "loader_vs_training"):
        assert_figure(results["loader"][name])
    for name in ("template_2p_vs_1p", "reference_2p_vs_1p"):
        assert_figure(results["scaling"][name])
    assert set(results["met"]) == set(results["targets"])
    assert all(isinstance(met, bool) for met in results["met"].values())
    assert results["machine"]["threads_per_process"] == 1
