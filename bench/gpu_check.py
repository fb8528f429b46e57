"""Prove a GPU machine: the generated project's real `train.py`, run the ways a GPU user runs it.

    bash scripts/gpu_check.sh [--dry-run] [--out build/gpu_check]

Generates the default project (as the benchmark does), writes the shipped real MNIST sample, checks
that the project installs into this environment (pip's dry run: its dependencies, this machine's
torch included), and runs:

- on one GPU, fits with the default precision, with `torch.compile` and with the data held on the
  GPU, each checking the device, precision, TF32 and pinning (`gpu_probe.py` in the run);
- images/s of the template against plain PyTorch on the same model and data, taking turns in the
  same process (the benchmark's `interleaved.py`);
- a fit whose checkpoints are written in the background;
- SIGTERM mid-epoch, then a resume that must end on the weights of an uninterrupted run, bitwise,
  and whose random generators (CPU and GPU) at the first resumed step equal the uninterrupted run's;
- with 2 or more GPUs, over NCCL: a 2-process fit, its SIGTERM and bitwise resume with each
  process's own generators, and the lost-node drill (SIGABRT to one process of a job of 2 nodes:
  every node must end with exit 75, which platforms retry).

It prints one PASS/WARN/FAIL/SKIP line per check and writes every figure to OUT/gpu_check.json
(each check's `seconds`: the time since the line before); it exits 1 when a check failed.
`--dry-run` runs the same checks on the CPU, shorter, where the expectations are a CPU's (float32,
no TF32, no pinning; the 2-process checks over gloo) and compiling is skipped: the template's
suite runs it.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import torch

from benchmark import TARGETS, Case, Runner, free_port, measured_env, prepare, project_parser
from gpu_probe import record_path

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent

# A fit, a pip run or a drill's wait ends after this: one that hangs leaves the other checks time (8 minutes in all).
RUN_TIMEOUT_S = 300
TIMED_OUT = 124  # as coreutils' timeout reports it
# A paced step outlasts the kit's 0.25 s between agreements on a stop (checkpoints/preemption.py), so that
# several processes agree after every step and a SIGTERM mid-epoch is saved mid-epoch, as on a slow model.
PACED_STEP_S = 0.3
LOST_NODE_TIMEOUT_S = 30  # the drill's cluster.timeout; every node must have ended within it plus 30 s
DDP_ROWS = ("ddp_fit", "ddp_preempt_resume", "ddp_rng_resume")
# "warn": the example pools adaptively, whose CUDA backward has no deterministic flag; the comparison judges.
DETERMINISTIC = ("--trainer.deterministic", "warn")


@dataclass
class Check:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    detail: str
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0  # since the line before

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


@dataclass
class Fit:
    """What a `train.py fit` left behind: its exit status and each process's probe record (empty if it wrote none)."""

    name: str
    status: int  # TIMED_OUT if it ran past RUN_TIMEOUT_S
    records: list[dict]
    out: Path  # the probe's: <out>.weights.pt holds the weights process 0 ended with
    log: Path

    @property
    def record(self) -> dict:
        return self.records[0]

    def exited(self) -> str:
        """How it ended, for a FAIL line: the status, its log, and the last error it printed."""
        said = last_error(self.log)
        return f"exit {self.status} (logs/{self.log.name}{': ' + said if said else ''})"

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out.with_name(f"{self.out.name}.weights.pt"), weights_only=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = project_parser(__doc__.split("\n\n")[0], TEMPLATE / "build" / "gpu_check")
    parser.add_argument("--dry-run", action="store_true", help="run the checks on the CPU, shorter")
    parser.add_argument("--repeats", type=int, help="throughput runs taking turns (default 3; 1 with --dry-run)")
    return parser.parse_args(argv)


def callback_option(class_path: str, **init_args: object) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def paced(marker: Path, at_step: int, seconds_per_step: float) -> str:
    """The kit's test pacing: a sleep after every step; at `at_step`, `<marker>.rank<r>` holds process r's id."""
    return callback_option("trainkit.testing.pacing.PaceSteps", marker=str(marker), at_step=at_step,
                           seconds_per_step=seconds_per_step)  # fmt: skip


class Fits:
    """`train.py fit` with the default config on this machine's accelerator, a run directory and a log each."""

    def __init__(self, project: Path, data_dir: Path, out: Path, accelerator: str) -> None:
        self.project, self.data_dir, self.out = project, data_dir, out
        self.accelerator = accelerator
        # Deterministic cuBLAS, so that a resumed run can be compared bitwise with an uninterrupted one.
        self.env = {**measured_env(project), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def command(self, name: str, steps: int, *overrides: str, processes: int = 1, run_dir: str = "") -> list[str]:
        return [
            sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml",
            "--data.data_dir", str(self.data_dir), "--data.download", "false",
            "--trainer.accelerator", self.accelerator, "--trainer.devices", str(processes),
            "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
            "--trainer.default_root_dir", str(self.out / "runs" / (run_dir or name)),
            *overrides,
        ]  # fmt: skip

    def run(
        self, name: str, steps: int, *overrides: str, processes: int = 1, run_dir: str = "", **probe: object
    ) -> Fit:
        """A fit of `steps` optimizer steps with the probe (`gpu_probe.GpuProbe(**probe)`), to its end."""
        out = self.out / "records" / name
        command = self.command(name, steps, *overrides, processes=processes, run_dir=run_dir)
        command.append(callback_option("gpu_probe.GpuProbe", out=str(out), **probe))
        with self.log(name).open("a") as log:
            status = run_to_end(command, self.project, self.env, log)
        paths = [record_path(out, rank) for rank in range(processes)]
        records = [json.loads(path.read_text()) if path.exists() else {} for path in paths]
        return Fit(name, status, records, out, self.log(name))

    def log(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"


def run_to_end(command: list[str], cwd: Path, env: dict[str, str], log: IO[str]) -> int:
    """Its exit status, TIMED_OUT if it runs past RUN_TIMEOUT_S; no process it started is left running."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return TIMED_OUT
    finally:  # also when this check is interrupted
        end_group(process)


def end_group(process: subprocess.Popen) -> None:
    """Kill what is left of the process group `process` leads (started with start_new_session) and reap it."""
    for pid in alive_in_group(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.wait()


def expected_setup(accelerator: str) -> dict:
    """What a run on this machine should train with, independently of the project's own choice."""
    if accelerator == "cpu":
        return {"device_type": "cpu", "precision": "32-true", "float32_matmul_precision": "highest",
                "pin_memory": False, "backend": "gloo"}  # fmt: skip
    ampere = torch.cuda.get_device_capability(0) >= (8, 0)
    return {
        "device_type": "cuda",
        "precision": "bf16-mixed" if ampere else "32-true",
        "float32_matmul_precision": "high" if ampere else "highest",  # TF32 where the GPU has it
        "pin_memory": True,
        "backend": "nccl",
    }


def setup_problems(record: dict, expected: dict, on_device: bool = False) -> list[str]:
    """How one process's record differs from what it should have trained with."""
    if not record:
        return ["the run wrote no record"]
    problems = []
    if record["device"].split(":")[0] != expected["device_type"]:
        problems.append(f"trained on {record['device']}, expected {expected['device_type']}")
    for key in ("precision", "float32_matmul_precision"):
        if record[key] != expected[key]:
            problems.append(f"{key} {record[key]}, expected {expected[key]}")
    pinned = expected["pin_memory"] and not on_device  # data already on the GPU needs no pinned copy
    if record["pin_memory"] != pinned:
        problems.append(f"pin_memory {record['pin_memory']}, expected {pinned}")
    if on_device and record.get("batch_device", "").split(":")[0] != expected["device_type"]:
        problems.append(f"batches arrived on {record.get('batch_device')}, expected the training device")
    if record["world_size"] > 1 and record["backend"] != expected["backend"]:
        problems.append(f"process group over {record['backend']}, expected {expected['backend']}")
    return problems


def fit_problems(fit: Fit, steps: int, expected: dict, on_device: bool, compiled: bool) -> list[str]:
    """Why a fit is not what it must be: ended at `steps`, every process on the expected setup, a device each."""
    problems = [fit.exited()] if fit.status != 0 else []
    for rank, record in enumerate(fit.records):
        named = f"process {rank}: " if len(fit.records) > 1 else ""
        problems += [named + problem for problem in setup_problems(record, expected, on_device)]
    devices = [record.get("device") for record in fit.records]
    if expected["device_type"] == "cuda" and len(set(devices)) < len(devices):
        problems.append(f"processes share a GPU: {devices}")
    if fit.status == 0 and fit.record.get("last_step") != steps:
        problems.append(f"ended at step {fit.record.get('last_step')}, expected {steps}")
    if compiled and not fit.record.get("compiled"):
        problems.append("the network was not compiled")
    return problems


def judge_fit(
    fit: Fit, steps: int, expected: dict, on_device: bool = False, compiled: bool = False, name: str = ""
) -> Check:
    """The check of a fit, named `name` or as the fit."""
    name = name or fit.name
    record, devices = fit.record, [record.get("device") for record in fit.records]
    keys = ("device", "precision", "float32_matmul_precision", "backend", "pin_memory", "batch_device", "compiled",
            "images_per_s", "max_memory_allocated_mb")  # fmt: skip
    figures = {**{key: record.get(key) for key in keys}, "devices": devices}
    problems = fit_problems(fit, steps, expected, on_device, compiled)
    if problems:
        return Check(name, "FAIL", "; ".join(problems), figures)
    where = f"{len(devices)} processes over {record['backend']}: {', '.join(devices)}"
    speed = f", {record['images_per_s']:.0f} images/s with validation and saves" if "images_per_s" in record else ""
    detail = (
        f"{where if len(devices) > 1 else record['device']}, {record['precision']},"
        f" matmul {record['float32_matmul_precision']}, pinned {record['pin_memory']},"
        f" batches on {record['batch_device']}{speed}"
    )
    return Check(name, "PASS", detail, figures)


def install_check(project: Path, log: Path) -> Check:
    """pip's dry run of `pip install -e PROJECT` from this environment alone: installs nothing, downloads nothing."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
               "-e", str(project)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    log.write_text(done.stdout + done.stderr)
    said = (done.stdout + done.stderr).strip().splitlines()
    last = said[-1] if said else ""
    if done.returncode != 0:
        # pip's last line is often "See above for details": its first error says what is missing.
        why = next((line for line in said if line.startswith("ERROR:")), last)
        return Check("install", "FAIL", f"pip install -e {project.name} would fail: {why} (all of it: {log})")
    return Check("install", "PASS", f"{last}: its dependencies hold in this environment (pip's dry run)")


def compiled_check(fits: Fits, steps: int, expected: dict) -> Check:
    if fits.accelerator == "cpu":  # compiling on a CPU takes minutes of the suite and proves nothing about GPUs
        return Check("fit_compiled", "SKIP", "dry run: torch.compile is checked on a GPU")
    return judge_fit(fits.run("fit_compiled", steps, "--model.compile", "true"), steps, expected, compiled=True)


def throughput_check(project: Path, data_dir: Path, out: Path, accelerator: str, repeats: int, steps: int) -> Check:
    settings = argparse.Namespace(out=out / "throughput", package=package_of(project), warmup=10, steps=steps,
                                  turn=10 if accelerator == "gpu" else 1, batch_size=None)  # fmt: skip
    runner = Runner(settings, project, data_dir, accelerator)
    precision = expected_setup(accelerator)["precision"]
    try:
        runs = [
            runner.interleaved(f"interleaved-{repeat}", Case("1 process", 1), precision) for repeat in range(repeats)
        ]
    except (RuntimeError, subprocess.TimeoutExpired) as error:  # the benchmark's runner raises for a failed run
        return Check("throughput", "FAIL", str(error).splitlines()[0] + " (throughput/logs)")
    ratios = [run["template"]["images_per_s"] / run["reference"]["images_per_s"] for run in runs]
    figures = {
        "template_images_per_s": statistics.median(run["template"]["images_per_s"] for run in runs),
        "reference_images_per_s": statistics.median(run["reference"]["images_per_s"] for run in runs),
        "template_vs_reference": statistics.median(ratios),
        "runs": len(runs),
    }
    target = TARGETS["template_vs_reference"]
    detail = (
        f"template {figures['template_images_per_s']:.0f} images/s, plain PyTorch"
        f" {figures['reference_images_per_s']:.0f}: {figures['template_vs_reference']:.3f}"
        f" (median of {len(runs)}, {min(ratios):.3f}-{max(ratios):.3f}; target {target})"
    )
    return Check("throughput", "PASS" if figures["template_vs_reference"] >= target else "WARN", detail, figures)


def background_save_check(fits: Fits, steps: int, expected: dict) -> Check:
    fit = fits.run("background_save", steps, "--checkpoint_saving.asynchronous", "true")
    reports = [line for line in fits.log(fit.name).read_text().splitlines() if "training waited" in line]
    problems = setup_problems(fit.record, expected)
    if fit.status != 0:
        problems.insert(0, fit.exited())
    if not reports:
        problems.append("no save reported how long training waited")
    last = fits.out / "runs" / fit.name / "checkpoints" / "last.ckpt"
    if fit.status == 0 and last.exists():
        saved_step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
        if saved_step != steps:
            problems.append(f"last.ckpt holds step {saved_step}, expected {steps}")
    elif fit.status == 0:
        problems.append("no last.ckpt")
    detail = "; ".join(problems) if problems else f"{len(reports)} saves; the last: {reports[-1].split('] ')[-1]}"
    return Check(fit.name, "FAIL" if problems else "PASS", detail, {"reports": reports[-3:]})


@dataclass
class Resume:
    """A run preempted by SIGTERM mid-epoch and started again, and an uninterrupted run of as many steps."""

    processes: int
    preempt_at: int
    preempted: Fit
    saved: dict  # where preempted.ckpt stands (saved_position); empty when there is none
    uninterrupted: Fit
    resumed: Fit | None


def saved_position(checkpoint: Path) -> dict:
    """The step a checkpoint holds, and how far into its epoch (0 batches or the last batch: at the epoch's end)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    progress = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    batches = progress["current"]["processed"]  # trained; "completed" counts a batch once its hooks are done
    return {"step": state["global_step"], "epoch": state["epoch"], "batches_into_epoch": batches,
            "mid_epoch": batches > 0 and not progress["is_last_batch"]}  # fmt: skip


def run_resume(fits: Fits, prefix: str, steps: int, processes: int) -> Resume:
    """Preempted at two thirds of `steps`, then uninterrupted and resumed runs that record their generators where
    the resumed run starts. Each process's streams differ (seed_per_rank), so that each must restore its own."""
    preempt_at = steps * 2 // 3
    run_dir = f"{prefix}resumed"
    pacing = (
        [paced(fits.out / "records" / f"{prefix}preempted.marker", preempt_at, PACED_STEP_S)] if processes > 1 else []
    )
    preempted = fits.run(f"{prefix}preempted", steps, *DETERMINISTIC, *pacing, processes=processes, run_dir=run_dir,
                         sigterm_at_step=preempt_at, seed_per_rank=True)  # fmt: skip
    checkpoint = fits.out / "runs" / run_dir / "checkpoints" / "preempted.ckpt"
    saved = saved_position(checkpoint) if preempted.status == 143 and checkpoint.exists() else {}
    # Every process stops at the step they agree on, a step or more after the signal: the resumed run starts there.
    rng_at = saved.get("step", -1)
    uninterrupted = fits.run(f"{prefix}uninterrupted", steps, *DETERMINISTIC, processes=processes,
                             rng_at_step=rng_at, seed_per_rank=True)  # fmt: skip
    resumed = None
    if saved:
        resumed = fits.run(run_dir, steps, *DETERMINISTIC, processes=processes, rng_at_step=rng_at,
                           seed_per_rank=True)  # fmt: skip
    return Resume(processes, preempt_at, preempted, saved, uninterrupted, resumed)


def resume_problems(resume: Resume) -> list[str]:
    """Why the preempted, uninterrupted and resumed runs cannot be compared; none when they can."""
    if not resume.saved:
        return [f"the preempted run, expected to exit 143 with preempted.ckpt: {resume.preempted.exited()}"]
    problems = [f"the {fit.name} run: {fit.exited()}" for fit in (resume.uninterrupted, resume.resumed)
                if fit.status != 0]  # fmt: skip
    if not problems and resume.resumed.record.get("first_step") != resume.saved["step"]:
        problems.append(f"the resumed run started at step {resume.resumed.record.get('first_step')},"
                        f" not at the saved {resume.saved['step']}")  # fmt: skip
    return problems


def resume_check(name: str, resume: Resume) -> Check:
    problems = resume_problems(resume)
    if problems:
        return Check(name, "FAIL", "; ".join(problems), {"saved": resume.saved})
    a, b = resume.uninterrupted.weights(), resume.resumed.weights()
    differing = [key for key in a if not torch.equal(a[key], b[key])]
    largest = max((float((a[key].float() - b[key].float()).abs().max()) for key in differing), default=0.0)
    figures = {"tensors": len(a), "differing": len(differing), "largest_difference": largest, "saved": resume.saved}
    if differing:
        return Check(name, "FAIL", f"{len(differing)} of {len(a)} tensors differ (largest {largest:.3g})", figures)
    saved = resume.saved
    where = f"{saved['batches_into_epoch']} batches into epoch {saved['epoch']}"
    detail = (f"SIGTERM to process 0 of {resume.processes} after step {resume.preempt_at}, saved at step"
              f" {saved['step']} ({where}), exit 143, resumed to {resume.resumed.record['last_step']}:"
              f" all {len(a)} tensors bitwise equal to an uninterrupted run")  # fmt: skip
    if not saved["mid_epoch"]:  # the weights agree, but the harder resume, from inside an epoch, was not tried
        return Check(name, "WARN", f"{detail}; but saved at the epoch's end, not mid-epoch", figures)
    return Check(name, "PASS", detail, figures)


def rng_check(name: str, resume: Resume) -> Check:
    """Each process's generators at the first resumed step equal its own in the uninterrupted run; with several
    processes, they differ between processes (each restored its own, not process 0's)."""
    problems = resume_problems(resume)
    if problems:
        return Check(name, "FAIL", "no resumed run to compare", {})
    uninterrupted = [record.get("rng_at_step") for record in resume.uninterrupted.records]
    resumed = [record.get("rng_at_step") for record in resume.resumed.records]
    figures = {"uninterrupted": uninterrupted, "resumed": resumed}
    step = resume.saved["step"]
    if None in uninterrupted or None in resumed:
        return Check(name, "FAIL", f"a process recorded no generator state at step {step}", figures)
    differing = [rank for rank in range(resume.processes) if uninterrupted[rank] != resumed[rank]]
    if differing:
        return Check(name, "FAIL", f"generators at step {step} differ from the uninterrupted run's in process(es)"
                     f" {differing}: {resumed} resumed, {uninterrupted} uninterrupted", figures)  # fmt: skip
    kinds = "CPU and GPU" if uninterrupted[0]["cuda"] else "CPU"
    if resume.processes == 1:
        return Check(
            name, "PASS", f"{kinds} generators at the first resumed step equal the uninterrupted run's", figures
        )
    streams = {(state["cpu"], state["cuda"]) for state in resumed}
    if len(streams) < resume.processes:
        return Check(name, "FAIL", f"processes resumed with the same generators, seeded apart: {resumed}", figures)
    return Check(name, "PASS", f"each of {resume.processes} processes resumed its own {kinds} generators (distinct),"
                 " equal to its own in the uninterrupted run", figures)  # fmt: skip


def resume_checks(fits: Fits, steps: int, prefix: str = "", processes: int = 1) -> list[Check]:
    resume = run_resume(fits, prefix, steps, processes)
    return [resume_check(f"{prefix}preempt_resume", resume), rng_check(f"{prefix}rng_resume", resume)]


def two_gpus_missing(accelerator: str) -> str:
    """Why the 2-process checks cannot run here; "" when they can (on the CPU they run over gloo)."""
    if accelerator == "gpu" and torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} GPU visible; 2 processes over NCCL need 2 GPUs"
    return ""


def ddp_checks(fits: Fits, steps: int, expected: dict) -> list[Check]:
    """A 2-process fit (the uninterrupted run of the resume) and its SIGTERM and resume, each process's generators."""
    resume = run_resume(fits, "ddp_", steps, processes=2)
    fit = judge_fit(resume.uninterrupted, steps, expected, name="ddp_fit")
    return [fit, resume_check("ddp_preempt_resume", resume), rng_check("ddp_rng_resume", resume)]


def node_env(fits: Fits, rank: int, port: int) -> dict[str, str]:
    """A node of a POD job of 2 nodes (platforms.py), on this machine: on a GPU machine, each node its own GPU."""
    env = dict(fits.env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if fits.accelerator == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank]
    return env


def alive_in_group(group: int) -> list[int]:
    """The processes of process group `group` still running (ended ones awaiting their parent do not count)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # after the command name, which may hold spaces: state, parent, process group
            state, _, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # ended meanwhile
        if int(pgrp) == group and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


def wait_for_markers(markers: list[Path], nodes: list[subprocess.Popen], timeout: float) -> str:
    """Wait until every marker exists; then "", else why not (a node ended first, or the time ran out)."""
    deadline = time.monotonic() + timeout
    while not all(marker.exists() for marker in markers):
        ended = [
            f"node {index} exited {node.returncode}" for index, node in enumerate(nodes) if node.poll() is not None
        ]
        if ended or time.monotonic() > deadline:
            return "; ".join(ended) or f"not every process reached step 3 within {timeout:.0f} s"
        time.sleep(0.2)
    return ""


def last_error(log: Path) -> str:
    lines = [line.split("]: ")[-1] for line in log.read_text().splitlines() if "error:" in line]
    return lines[-1] if lines else ""


def wait_for_nodes(nodes: list[subprocess.Popen], since: float, within: float) -> tuple[list, list]:
    """Each node's exit status ("running" if still running `within` s after `since`), and its seconds to end."""
    ended_at: dict[int, float] = {}
    while len(ended_at) < len(nodes) and time.monotonic() < since + within:
        ended_at.update({index: time.monotonic() for index, node in enumerate(nodes)
                         if index not in ended_at and node.poll() is not None})  # fmt: skip
        time.sleep(0.1)
    statuses = [nodes[index].returncode if index in ended_at else "running" for index in range(len(nodes))]
    return statuses, [round(ended_at[index] - since, 1) if index in ended_at else None for index in range(len(nodes))]


def lost_node_check(fits: Fits) -> Check:
    """Two nodes of one process each; once both trained 3 steps, SIGABRT to node 1's process, as NCCL's watchdog
    ends a process whose collective failed: each node must end with exit 75 (a retry) within the timeout plus 30 s."""
    marker = fits.out / "records" / "lost_node.marker"
    command = fits.command("lost_node", 10**6, "--cluster.timeout", f"0:00:{LOST_NODE_TIMEOUT_S}",
                           paced(marker, at_step=3, seconds_per_step=0.2))  # fmt: skip
    port, logs = free_port(), [fits.log(f"lost_node{rank}") for rank in range(2)]
    nodes = [subprocess.Popen(command, cwd=fits.project, env=node_env(fits, rank, port), stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)  # its own process group, as a node
             for rank, log in enumerate(logs)]  # fmt: skip
    try:
        not_started = wait_for_markers([Path(f"{marker}.rank{rank}") for rank in range(2)], nodes, RUN_TIMEOUT_S)
        if not_started:
            return Check("lost_node", "FAIL", f"{not_started} (logs/lost_node0.log, logs/lost_node1.log)")
        os.kill(int(Path(f"{marker}.rank1").read_text()), signal.SIGABRT)
        statuses, seconds = wait_for_nodes(nodes, time.monotonic(), LOST_NODE_TIMEOUT_S + 30)
        left = [pid for node in nodes for pid in alive_in_group(node.pid)]
    finally:
        for node in nodes:
            end_group(node)
    lines = [last_error(log) for log in logs]
    figures = {"statuses": statuses, "seconds_after_abort": seconds, "lines": lines, "left_running": left}
    ended = ", ".join(f"node {rank} exit {status} after {after} s" for rank, (status, after)
                      in enumerate(zip(statuses, seconds, strict=True)))  # fmt: skip
    if statuses != [75, 75] or left:
        stragglers = f"; {len(left)} process(es) still running" if left else ""
        return Check("lost_node", "FAIL", f"SIGABRT to node 1's process: {ended}, expected 75 each{stragglers}"
                     " (logs/lost_node0.log, logs/lost_node1.log)", figures)  # fmt: skip
    backend = "NCCL" if fits.accelerator == "gpu" else "gloo"
    return Check("lost_node", "PASS", f"SIGABRT to node 1's process ({backend}): {ended}; node 0 said: {lines[0]}",
                 figures)  # fmt: skip


def package_of(project: Path) -> str:
    return next(path.parent.name for path in (project / "src").glob("*/__init__.py") if path.parent.name != "trainkit")


def machine(accelerator: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "accelerator": accelerator, "cpus": os.cpu_count()}  # fmt: skip
    if torch.cuda.is_available():
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split("\n")[0]
    return info


def plan(args: argparse.Namespace, project: Path, data_dir: Path, accelerator: str) -> list[Callable[[], list]]:
    """The checks in the order they run, each a call that returns its lines."""
    fits = Fits(project, data_dir, args.out, accelerator)
    expected = expected_setup(accelerator)
    # An epoch of the 8,000 digits is 57 steps on 1 process and 29 on 2: every run spans an epoch's end.
    steps, ddp_steps = (40, 40) if args.dry_run else (150, 60)
    repeats = args.repeats or (1 if args.dry_run else 3)
    throughput_steps = 20 if args.dry_run else 200
    missing = two_gpus_missing(accelerator)

    def fit(name: str, *overrides: str, on_device: bool = False) -> list[Check]:
        return [judge_fit(fits.run(name, steps, *overrides), steps, expected, on_device=on_device)]

    def skipped(*names: str) -> list[Check]:
        return [Check(name, "SKIP", missing) for name in names]

    return [
        lambda: [install_check(project, args.out / "logs" / "install.log")],
        lambda: fit("fit_default"),
        lambda: [compiled_check(fits, steps, expected)],
        lambda: fit("fit_data_on_device", "--data.on_device", "true", on_device=True),
        lambda: [throughput_check(project, data_dir, args.out, accelerator, repeats, throughput_steps)],
        lambda: [background_save_check(fits, steps, expected)],
        lambda: resume_checks(fits, steps),
        lambda: skipped(*DDP_ROWS) if missing else ddp_checks(fits, ddp_steps, expected),
        lambda: skipped("lost_node") if missing else [lost_node_check(fits)],
    ]


def write_results(out: Path, accelerator: str, checks: list[Check], started: float) -> float:
    """The figures so far to gpu_check.json (after every check: a run cut short keeps those before); its seconds."""
    seconds = time.monotonic() - started
    results = {"machine": machine(accelerator), "seconds": seconds, "checks": [asdict(check) for check in checks]}
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    return seconds


def finish(out: Path, accelerator: str, checks: list[Check], started: float) -> int:
    """Write the figures, say where they are; 1 if a check failed."""
    seconds = write_results(out, accelerator, checks, started)
    failed = [check.name for check in checks if check.status == "FAIL"]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks did not fail in {seconds:.0f} s;"
          f" figures: {out / 'gpu_check.json'}, logs: {out / 'logs'}")  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    accelerator = "cpu" if args.dry_run else "gpu"
    started = time.monotonic()
    # What an earlier check left; a project given with --project stays.
    for earlier in ("logs", "records", "runs", "throughput"):
        shutil.rmtree(args.out / earlier, ignore_errors=True)
    for directory in ("logs", "records"):
        (args.out / directory).mkdir(parents=True)
    if accelerator == "gpu" and not torch.cuda.is_available():
        check = Check("gpu", "FAIL", f"torch {torch.__version__} sees no CUDA GPU here; --dry-run checks on the CPU")
        print(check.line())
        return finish(args.out, accelerator, [check], started)
    print(json.dumps(machine(accelerator)), flush=True)
    project, data_dir = prepare(args)
    checks: list[Check] = []
    for run_checks in plan(args, project, data_dir, accelerator):
        before = time.monotonic()
        for check in run_checks():
            check.seconds, before = round(time.monotonic() - before, 1), time.monotonic()
            print(check.line(), flush=True)
            checks.append(check)
        write_results(args.out, accelerator, checks, started)
    return finish(args.out, accelerator, checks, started)


if __name__ == "__main__":
    sys.exit(main())
