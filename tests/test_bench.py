"""The benchmark's code path, in its smallest configuration: every figure reaches results.json.

Figures are only checked for being there and being numbers; timings are never asserted on.
"""

import json
import math
import sys

from .conftest import TEMPLATE

sys.path.insert(0, str(TEMPLATE / "bench"))

import benchmark
import checkpoint_store
import step_parts
import stop_latency

COMPARISON_FIGURES = (
    "template_images_per_s",
    "reference_images_per_s",
    "template_vs_reference",
    "template_vs_reference_median_step",
    "template_vs_reference_cpu_time",
    "template_overhead_ms_per_step",
)


def assert_figure(value) -> None:
    assert isinstance(value, float) and math.isfinite(value), value


def test_a_minimal_benchmark_run_writes_every_figure(default_project, real_mnist, tmp_path):
    benchmark.main(
        ["--out", str(tmp_path), "--project", str(default_project), "--data-dir", str(real_mnist),
         "--repeats", "1", "--separate-repeats", "1", "--warmup", "1", "--steps", "3", "--turn", "2",
         "--loader-seconds", "0.2", "--accelerator", "cpu"]
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())

    assert set(results["throughput"]) == {"1 process", "2 processes (DDP)"}
    for case in results["throughput"].values():
        for comparison in (case, case["separate_processes"], case["lightning_alone"]):
            for name in COMPARISON_FIGURES:
                assert_figure(comparison[name])
            assert all(faults >= 0 for faults in comparison["page_faults_per_step"].values())
        assert_figure(case["kit_overhead_ms_per_step"])
    # Taking turns, each side timed its own 3 steps after the warm-up step: two turns each.
    for run in results["samples"]["interleaved: 1 process"] + results["samples"]["lightning alone: 1 process"]:
        assert run["template"]["steps_timed"] == run["reference"]["steps_timed"] == 3
    for name in (
        "template_s", "reference_s", "import_floor_s", "template_over_floor_s",
        "import_floor_collector_paused_s", "template_over_collector_paused_floor_s",
    ):  # fmt: skip
        assert_figure(results["startup"][name])
    for name in ("loader_images_per_s", "training_images_per_s", "loader_vs_training"):
        assert_figure(results["loader"][name])
    assert set(results["loader"]["streaming"]) == {"0 workers", "2 workers", "4 workers"}
    for figures in results["loader"]["streaming"].values():
        for name in ("images_per_s", "vs_in_memory", "vs_training"):
            assert_figure(figures[name])
    for name in ("template_2p_vs_1p", "reference_2p_vs_1p"):
        assert_figure(results["scaling"][name])
    assert set(results["met"]) == set(results["targets"])
    assert all(isinstance(met, bool) for met in results["met"].values())
    assert results["machine"]["threads_per_process"] == 1


def test_a_restarted_clock_counts_only_its_own_steps(monkeypatch):
    import timing

    now = iter(range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(now)))
    clock = timing.StepClock(warmup=1, steps=3)
    clock.tick(epoch=0, images=10)  # t=0: the warm-up step; the window starts here
    clock.restart(epoch=0)  # t=1: another side ran from 0 to 1
    clock.tick(epoch=0, images=10)  # t=2
    clock.tick(epoch=1, images=10)  # t=3: crossed an epoch boundary, not counted
    clock.restart(epoch=1)  # t=4
    clock.tick(epoch=1, images=10)  # t=5
    clock.tick(epoch=1, images=10)  # after the window: ignored

    result = clock.result()
    assert clock.done and result["steps_timed"] == 2
    assert result["images_per_s"] == 20 / 2  # the intervals 1-2 and 4-5


def test_checkpoint_store_timings_reach_the_table_and_results_json(default_project, tmp_path, capsys):
    # A tiny "large" model: the same code path as the 1 GB one, against a real moto S3 server.
    checkpoint_store.main(
        ["--out", str(tmp_path), "--project", str(default_project), "--repeats", "2", "--large-parameters", "10000"]
    )
    results = json.loads((tmp_path / "results.json").read_text())

    assert set(results["cases"]) == {"example model", "large: weights", "large: weights+AdamW"}
    assert results["parameters"]["example model"] == 421_642  # the default config's ImageClassifier
    for name, figures in results["cases"].items():
        assert len(results["samples"][name]) == 2
        for field in checkpoint_store.TIMED:
            assert_figure(figures[field])
        assert figures["save_and_upload_s"] >= figures["blocked_s"]
        assert set(figures["grace_fraction"]) == set(checkpoint_store.GRACE_PERIODS_S)
        assert set(figures["computed"]) == set(checkpoint_store.BANDWIDTHS)
    sizes = {name: figures["bytes"] for name, figures in results["cases"].items()}
    assert 2.5 < sizes["large: weights+AdamW"] / sizes["large: weights"] < 3.5  # AdamW keeps two moments
    table = capsys.readouterr().out
    assert "preemption: save + wait()" in table and "of AWS spot (120 s)" in table


def test_the_stop_benchmark_times_each_stop_quiet_and_loaded(default_project, real_mnist, tmp_path):
    results = stop_latency.main(
        ["--out", str(tmp_path), "--project", str(default_project), "--data-dir", str(real_mnist),
         "--repeats", "1", "--at-step", "3", "--load-warmup", "5"]
    )  # fmt: skip
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert set(results) == {"quiet", "loaded"}
    for samples in results.values():
        (sample,) = samples
        for name in ("to_saved_s", "saved_to_exit_s", "total_s"):
            assert_figure(sample[name])


def test_the_parts_of_a_step_reach_their_json(default_project, real_mnist, tmp_path):
    parts = step_parts.main(
        ["--out", str(tmp_path), "--project", str(default_project), "--data-dir", str(real_mnist),
         "--steps", "12", "--warmup", "2"]
    )  # fmt: skip
    assert json.loads((tmp_path / "parts-1p.json").read_text()) == parts
    assert parts["steps"] >= 5
    assert_figure(parts["median_step_ms"])
    for name in (
        "model: train_accuracy.update",
        "data: the next batch (Lightning's fetcher)",
        "optimizer: AdamW's update",
        "Lightning calls callbacks' on_train_batch_end",
        "callback PreemptionCheckpoint.on_train_batch_end",
    ):
        assert_figure(parts["ms_per_step"][name])
