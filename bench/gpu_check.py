"""Prove a GPU machine: the generated project's real `train.py`, run the ways a GPU user runs it.

    bash scripts/gpu_check.sh [--dry-run] [--out build/gpu_check]

Generates the default project, writes the shipped real MNIST sample, and runs, on one GPU:

- fits with the default precision, with `torch.compile`, and with the data held on the GPU, each
  checking the device, precision, TF32 and where batches come from (`gpu_probe.py` in the run);
- images/s of the template against plain PyTorch on the same model and data, taking turns in the
  same process (the benchmark's `interleaved.py`);
- a fit whose checkpoints are written in the background;
- SIGTERM mid-epoch, then a resume that must end on the weights of an uninterrupted run, bitwise,
  and whose random generators (CPU and GPU) at the first resumed step equal the uninterrupted run's;
- with 2 or more GPUs, a 2-process DDP fit over NCCL.

It prints one PASS/WARN/FAIL/SKIP line per check and writes every figure to OUT/gpu_check.json;
it exits 1 when a check failed. `--dry-run` runs the same checks on the CPU, shorter, where the
expectations are a CPU's (no pinning, float32, no TF32): the template's suite runs it.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from benchmark import TARGETS, Case, Runner, prepare

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent


@dataclass
class Check:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    detail: str
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TEMPLATE / "build" / "gpu_check", help="work and result directory")
    parser.add_argument("--dry-run", action="store_true", help="run the checks on the CPU, shorter")
    parser.add_argument("--project", type=Path, help="an already generated project (default: generate one)")
    parser.add_argument("--data-dir", type=Path, help="MNIST in torchvision's layout (default: the shipped sample)")
    parser.add_argument("--repeats", type=int, help="throughput runs taking turns (default 3; 1 with --dry-run)")
    return parser.parse_args(argv)


class Fits:
    """`train.py fit` with the default config, this machine's accelerator, the probe, and a run directory each."""

    def __init__(self, project: Path, data_dir: Path, out: Path, accelerator: str, env: dict[str, str]) -> None:
        self.project, self.data_dir, self.out = project, data_dir, out
        self.accelerator = accelerator
        # Deterministic kernels, so that a resumed run can be compared bitwise with an uninterrupted one.
        self.env = {**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def run(self, name: str, steps: int, *overrides: str, run_dir: str | None = None, **probe: int) -> tuple[int, dict]:
        """Exit status and the probe's record of a fit of `steps` optimizer steps."""
        record = self.out / f"{name}.json"
        probe_config = json.dumps({"class_path": "gpu_probe.GpuProbe", "init_args": {"out": str(record), **probe}})
        command = [
            sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml",
            "--data.data_dir", str(self.data_dir), "--data.download", "false",
            "--trainer.accelerator", self.accelerator, "--trainer.devices", "1",
            "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
            "--trainer.default_root_dir", str(self.out / "runs" / (run_dir or name)),
            *overrides,
            f"--trainer.callbacks+={probe_config}",
        ]  # fmt: skip
        with open(self.out / "logs" / f"{name}.log", "a") as log:
            done = subprocess.run(command, cwd=self.project, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=900, check=False)  # fmt: skip
        return done.returncode, json.loads(record.read_text()) if record.exists() else {}

    def log(self, name: str) -> str:
        return (self.out / "logs" / f"{name}.log").read_text()

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"{name}.weights.pt", weights_only=True)


def expected_setup(accelerator: str) -> dict:
    """What a run on this machine should train with, independently of the project's own choice."""
    if accelerator == "cpu":
        return {"device_type": "cpu", "precision": "32-true", "float32_matmul_precision": "highest", "pin_memory": False}
    ampere = torch.cuda.get_device_capability(0) >= (8, 0)
    return {
        "device_type": "cuda",
        "precision": "bf16-mixed" if ampere else "32-true",
        "float32_matmul_precision": "high" if ampere else "highest",  # TF32 where the GPU has it
        "pin_memory": True,
    }


def setup_problems(record: dict, expected: dict, on_device: bool = False) -> list[str]:
    if not record:
        return ["the run wrote no record"]
    problems = []
    device_type = record["device"].split(":")[0]
    if device_type != expected["device_type"]:
        problems.append(f"trained on {record['device']}, expected {expected['device_type']}")
    for key in ("precision", "float32_matmul_precision"):
        if record[key] != expected[key]:
            problems.append(f"{key} {record[key]}, expected {expected[key]}")
    pinned = expected["pin_memory"] and not on_device  # data already on the GPU needs no pinned copy
    if record["pin_memory"] != pinned:
        problems.append(f"pin_memory {record['pin_memory']}, expected {pinned}")
    batch_type = record["batch_device"].split(":")[0]
    if on_device and batch_type != expected["device_type"]:
        problems.append(f"batches arrived on {record['batch_device']}, expected the training device")
    return problems


def fit_check(fits: Fits, name: str, steps: int, expected: dict, *overrides: str, on_device: bool = False) -> Check:
    status, record = fits.run(name, steps, *overrides)
    problems = setup_problems(record, expected, on_device)
    if status != 0:
        problems.insert(0, f"exit {status} (logs/{name}.log)")
    elif record.get("last_step") != steps:
        problems.append(f"ended at step {record.get('last_step')}, expected {steps}")
    if "--model.compile" in overrides and not record.get("compiled"):
        problems.append("the network was not compiled")
    figures = {key: record.get(key) for key in ("device", "precision", "float32_matmul_precision", "pin_memory",
                                                 "batch_device", "compiled", "images_per_s", "max_memory_allocated_mb")}  # fmt: skip
    speed = f", {record['images_per_s']:.0f} images/s with validation and saves" if "images_per_s" in record else ""
    detail = "; ".join(problems) if problems else (
        f"{record['device']}, {record['precision']}, matmul {record['float32_matmul_precision']},"
        f" pinned {record['pin_memory']}, batches on {record['batch_device']}{speed}"
    )
    return Check(name, "FAIL" if problems else "PASS", detail, figures)


def throughput_check(project: Path, data_dir: Path, out: Path, accelerator: str, repeats: int, steps: int) -> Check:
    settings = argparse.Namespace(out=out / "throughput", package=package_of(project), warmup=10, steps=steps,
                                  turn=10 if accelerator == "gpu" else 1, batch_size=None)  # fmt: skip
    runner = Runner(settings, project, data_dir, accelerator)
    precision = expected_setup(accelerator)["precision"]
    runs = [runner.interleaved(f"interleaved-{repeat}", Case("1 process", 1), precision) for repeat in range(repeats)]
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
    status, record = fits.run("background_save", steps, "--checkpoint_saving.asynchronous", "true")
    reports = [line for line in fits.log("background_save").splitlines() if "training waited" in line]
    problems = setup_problems(record, expected)
    if status != 0:
        problems.insert(0, f"exit {status} (logs/background_save.log)")
    if not reports:
        problems.append("no save reported how long training waited")
    last = fits.out / "runs" / "background_save" / "checkpoints" / "last.ckpt"
    if status == 0 and last.exists():
        saved_step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
        if saved_step != steps:
            problems.append(f"last.ckpt holds step {saved_step}, expected {steps}")
    elif status == 0:
        problems.append("no last.ckpt")
    detail = "; ".join(problems) if problems else f"{len(reports)} saves; the last: {reports[-1].split('] ')[-1]}"
    return Check("background_save", "FAIL" if problems else "PASS", detail, {"reports": reports[-3:]})


def resume_checks(fits: Fits, steps: int, preempt_at: int) -> list[Check]:
    """A run preempted by SIGTERM mid-epoch and started again, against an uninterrupted one: same weights, same RNG."""
    # "warn": the example pools adaptively, whose CUDA backward has no deterministic flag; the comparison judges.
    deterministic = ("--trainer.deterministic", "warn")
    status_stop, _ = fits.run("preempted", steps, *deterministic, run_dir="resumed", sigterm_at_step=preempt_at)
    checkpoint = fits.out / "runs" / "resumed" / "checkpoints" / "preempted.ckpt"
    if status_stop != 143 or not checkpoint.exists():
        failed = f"the preempted run exited {status_stop}, expected 143 and preempted.ckpt (logs/preempted.log)"
        return [Check("preempt_resume", "FAIL", failed), Check("rng_resume", "FAIL", "no resumed run to compare")]
    # Every process stops at the step they agree on, a step or two after the signal: the resumed run starts there.
    saved_at = torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"]
    status_whole, whole = fits.run("uninterrupted", steps, *deterministic, rng_at_step=saved_at)
    status_resume, resumed = fits.run("resumed", steps, *deterministic, rng_at_step=saved_at)
    problems = []
    if status_whole != 0:
        problems.append(f"the uninterrupted run exited {status_whole} (logs/uninterrupted.log)")
    if status_resume != 0:
        problems.append(f"the resumed run exited {status_resume} (logs/resumed.log)")
    elif resumed.get("first_step") != saved_at:
        problems.append(f"the resumed run started at step {resumed.get('first_step')}, not at the saved {saved_at}")
    if problems:
        failed = "; ".join(problems)
        return [Check("preempt_resume", "FAIL", failed), Check("rng_resume", "FAIL", "no resumed run to compare")]

    a, b = fits.weights("uninterrupted"), fits.weights("resumed")
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    largest = max((float((a[name].float() - b[name].float()).abs().max()) for name in differing), default=0.0)
    if differing:
        resume = Check("preempt_resume", "FAIL", f"{len(differing)} of {len(a)} tensors differ (largest {largest:.3g})")
    else:
        resume = Check("preempt_resume", "PASS",
                       f"SIGTERM after step {preempt_at} (mid-epoch), saved at {saved_at}, exit 143, resumed to {steps}:"
                       f" all {len(a)} tensors bitwise equal to an uninterrupted run")  # fmt: skip
    resume.figures = {"tensors": len(a), "differing": len(differing), "largest_difference": largest}

    states_whole, states_resumed = whole.get("rng_at_step"), resumed.get("rng_at_step")
    if states_whole is None or states_resumed is None:
        rng = Check("rng_resume", "FAIL", f"no generator state recorded at step {saved_at}")
    elif states_whole != states_resumed:
        rng = Check("rng_resume", "FAIL", f"generators at step {saved_at}: {states_resumed} resumed, {states_whole} uninterrupted")
    else:
        generators = "CPU and GPU" if states_whole["cuda"] else "CPU"
        rng = Check("rng_resume", "PASS", f"{generators} generators at the first resumed step equal the uninterrupted run's")
    rng.figures = {"uninterrupted": states_whole, "resumed": states_resumed}
    return [resume, rng]


def nccl_check(fits: Fits, steps: int) -> Check:
    if fits.accelerator == "cpu" or torch.cuda.device_count() < 2:
        return Check("nccl", "SKIP", f"{torch.cuda.device_count()} GPU(s) visible; NCCL between processes needs 2")
    status, record = fits.run("nccl", steps, "--trainer.devices", "2")
    if status != 0 or record.get("world_size") != 2:
        return Check("nccl", "FAIL", f"2-process fit exited {status}, world size {record.get('world_size')}")
    return Check("nccl", "PASS", f"2 processes over NCCL trained {steps} steps", {"world_size": 2})


def package_of(project: Path) -> str:
    return next(path.parent.name for path in (project / "src").glob("*/__init__.py") if path.parent.name != "trainkit")


def machine(accelerator: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "accelerator": accelerator, "cpus": os.cpu_count()}  # fmt: skip
    if accelerator == "gpu":
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    accelerator = "cpu" if args.dry_run else "gpu"
    if accelerator == "gpu" and not torch.cuda.is_available():
        print("FAIL gpu: torch sees no CUDA GPU here (torch", torch.__version__, "); --dry-run checks on the CPU")
        return 1
    started = time.monotonic()
    for earlier in ("logs", "runs", "throughput"):  # what an earlier check wrote; a project given with --project stays
        shutil.rmtree(args.out / earlier, ignore_errors=True)
    (args.out / "logs").mkdir(parents=True)
    project, data_dir = prepare(args)
    steps = 40 if args.dry_run else 150  # an epoch of the 8,000 digits is 57 steps: both span an epoch boundary
    repeats = args.repeats or (1 if args.dry_run else 3)
    runner_env = Runner(argparse.Namespace(out=args.out / "env"), project, data_dir, accelerator).env
    fits = Fits(project, data_dir, args.out, accelerator, runner_env)
    expected = expected_setup(accelerator)
    print(json.dumps(machine(accelerator)), flush=True)

    checks = [fit_check(fits, "fit_default", steps, expected)]
    if args.dry_run:  # compiling on a CPU takes minutes of the suite and proves nothing about GPUs
        checks.append(Check("fit_compiled", "SKIP", "dry run"))
    else:
        checks.append(fit_check(fits, "fit_compiled", steps, expected, "--model.compile", "true"))
    checks.append(fit_check(fits, "fit_data_on_device", steps, expected, "--data.on_device", "true", on_device=True))
    for check in checks:
        print(check.line(), flush=True)
    for check in [
        throughput_check(project, data_dir, args.out, accelerator, repeats, 20 if args.dry_run else 200),
        background_save_check(fits, steps, expected),
        *resume_checks(fits, steps, preempt_at=steps * 2 // 3),
        nccl_check(fits, steps),
    ]:
        print(check.line(), flush=True)
        checks.append(check)
    results = {
        "machine": machine(accelerator),
        "seconds": time.monotonic() - started,
        "checks": [asdict(check) for check in checks],
    }
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    failed = [check.name for check in checks if check.status == "FAIL"]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks did not fail in {results['seconds']:.0f} s;"
          f" figures: {args.out / 'gpu_check.json'}, logs: {args.out / 'logs'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
