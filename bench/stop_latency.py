"""How long a run takes from SIGTERM to its exit, on one process, on a quiet machine and beside another training.

A platform that stops a job sends SIGTERM, then SIGKILL after a grace period: 30 s by default on
Kubernetes (`terminationGracePeriodSeconds`). The generated project's default `fit` (real MNIST,
wandb offline, every callback of the default config) runs on one process; once it has trained a
few steps, SIGTERM goes to it, as Kubernetes sends it, and the time to its exit (143) is measured
in two parts: until its "SIGTERM: saved ..." line (the step in flight, the agreement, the save)
and from that line to the exit (wandb, the loaders, the interpreter). "Loaded" runs the same
beside a 2-process training of the same project that keeps both cores busy the whole time.
Medians over the repeats; every sample is in OUT/results.json.

    python bench/stop_latency.py [--out build/bench/stop] [--repeats 5]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark import TEMPLATE, prepare, project_parser

SAVED_LINE = "SIGTERM: saved"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = project_parser(__doc__.splitlines()[0], TEMPLATE / "build" / "bench" / "stop")
    parser.add_argument("--repeats", type=int, default=5, help="stops measured on each machine state")
    parser.add_argument("--at-step", type=int, default=20, help="the step after which SIGTERM is sent")
    parser.add_argument("--load-warmup", type=float, default=20, help="seconds for the other training to start")
    return parser.parse_args(argv)


def fit_command(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml",
        "--data.data_dir", str(data_dir), "--data.download", "false", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "-1", "--trainer.default_root_dir", str(run_dir), *extra,
    ]  # fmt: skip


def one_stop(project: Path, data_dir: Path, work: Path, env: dict[str, str], at_step: int) -> dict[str, float]:
    """SIGTERM once step `at_step` is done; seconds to the saved line and to the exit."""
    work.mkdir(parents=True, exist_ok=True)
    marker, log = work / "step-done", work / "fit.log"
    pace = ["--trainer.callbacks+=trainkit.testing.pacing.PaceSteps", "--trainer.callbacks.marker", str(marker),
            "--trainer.callbacks.at_step", str(at_step), "--trainer.callbacks.seconds_per_step", "0"]  # fmt: skip
    with log.open("w") as output:
        job = subprocess.Popen(fit_command(data_dir, work / "run", *pace), cwd=project, env=env, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before step {at_step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    saved = None
    while job.poll() is None:
        if saved is None and SAVED_LINE in log.read_text():
            saved = time.monotonic()
        time.sleep(0.01)
    ended = time.monotonic()
    if job.returncode != 143 or saved is None:
        raise RuntimeError(
            f"exit {job.returncode}, saved line {'seen' if saved else 'missing'}:\n{log.read_text()[-3000:]}"
        )
    return {"to_saved_s": saved - signalled, "saved_to_exit_s": ended - saved, "total_s": ended - signalled}


def measure(project: Path, data_dir: Path, work: Path, env: dict[str, str], args: argparse.Namespace) -> list[dict]:
    samples = []
    for repeat in range(args.repeats):
        sample = one_stop(project, data_dir, work / f"stop-{repeat}", env, args.at_step)
        print(f"  {work.name} {repeat + 1}/{args.repeats}: {sample['total_s']:.2f} s", flush=True)
        samples.append(sample)
    return samples


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    project, data_dir = prepare(args)
    source = os.pathsep.join(filter(None, [str(project / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=source)
    results = {"quiet": measure(project, data_dir, args.out / "quiet", env, args)}

    load_log = args.out / "load.log"  # the other training, on both cores
    with load_log.open("w") as output:
        load = subprocess.Popen(fit_command(data_dir, args.out / "load-run", "--trainer.devices", "2"), cwd=project,
                                env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        time.sleep(args.load_warmup)  # its start-up is over: both cores train
        if load.poll() is not None:
            raise RuntimeError(f"the loading training ended:\n{load_log.read_text()[-3000:]}")
        results["loaded"] = measure(project, data_dir, args.out / "loaded", env, args)
    finally:
        os.killpg(load.pid, signal.SIGKILL)
        load.wait()

    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nSIGTERM to exit, one process, median of {args.repeats} (s)")
    print(f"{'machine':8} {'to saved':>9} {'saved to exit':>14} {'total':>7} {'slowest':>8}")
    for state, samples in results.items():
        median = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
        slowest = max(sample["total_s"] for sample in samples)
        to_saved, saved_to_exit, total = median["to_saved_s"], median["saved_to_exit_s"], median["total_s"]
        print(f"{state:8} {to_saved:9.2f} {saved_to_exit:14.2f} {total:7.2f} {slowest:8.2f}")
    return results


if __name__ == "__main__":
    main()
