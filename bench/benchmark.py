"""Measure a generated project against plain PyTorch, side by side, on this machine.

Generates the default project, writes the shipped real MNIST sample in torchvision's layout, then
repeats, so that drifting machine load touches every case alike:

- the template's real `fit` (train.py with the default config: wandb offline, checkpointing,
  progress bar) against a plain PyTorch loop (`reference.py`), with 1 process and with 2 DDP
  processes, steady-state images/s (`timing.py`), measured two ways:
  - taking turns in the same processes (`interleaved.py`): the plain loop trains between blocks
    of the template's steps, so whatever makes one process faster than the next cancels out.
    This is the figure the target is judged on;
  - in separate processes, back to back (`step_timer.py` in the template's run): what a user
    sees, with each process's own speed in it;
  and the project's model and DataModule in Lightning's own Trainer with nothing of the kit
  (`lightning_alone.py`), taking turns with the plain loop the same way: what the template adds
  to a step splits into Lightning's own loop and the kit's cost (the template's less Lightning's);
- start-up: process start to first optimizer step, and the floor of importing torch, torchvision
  and lightning in a fresh process, also with the garbage collector paused meanwhile, as the
  template's train.py imports them;
- the DataModule's training loader alone (`loader.py`), in memory and streamed from chunks with
  0, 2 and 4 loader workers.

Two things are held the same for every process, because they move throughput more than anything
the template does:
- one torch thread per process (OMP_NUM_THREADS=1), so 2 processes on 2 cores measure scaling,
  not thread contention;
- glibc's malloc keeps freed memory for reuse (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_).
  By default it hands large freed blocks (a batch's activations) back to the system and takes
  them again on the next step; whether a process falls into that pattern is chance (from about 0
  to 6,000 page faults per step here) and costs it up to 20% in either program. With
  --glibc-malloc-defaults the CPU run also measures one case with glibc's defaults, to show that effect.

Medians go to a table and to OUT/results.json.

    python bench/benchmark.py [--out build/bench] [--repeats 5] [--separate-repeats 3] [--steps 60]
"""

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment_config import init_args

BENCH = Path(__file__).resolve().parent
TEMPLATE = BENCH.parent

IMPORT_FLOOR = "import torch, torchvision, lightning"
# The same imports as the template's train.py does them: no garbage collection until they are done.
IMPORT_FLOOR_COLLECTOR_PAUSED = f"import gc; gc.disable(); {IMPORT_FLOOR}; gc.freeze(); gc.enable()"
TARGETS = {
    "template_vs_reference": 0.98,
    # What the template adds to each step over plain PyTorch, taking turns: on one process, and under DDP.
    "overhead_ms_per_step_1_process": 1.0,
    "overhead_ms_per_step_ddp": 2.0,
    "loader_vs_training": 5.0,
    "streaming_vs_training": 5.0,
    "startup_over_floor_s": 2.0,
}
# Loader workers the streamed data path is measured with; the target is judged at the streaming config's own.
STREAMING_WORKERS = (0, 2, 4)
STREAMING_DEFAULT_WORKERS = 2
REUSE_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
# On a GPU the template's 1-process run is repeated with each of these overrides of the default config.
GPU_VARIANTS = {
    "eager 32-true": ["--trainer.precision", "32-true"],
    "compiled": ["--model.compile", "true"],
    "data on the GPU": ["--data.on_device", "true"],
}
CLUSTER_PREFIXES = ("SING_", "SLURM_", "TORCHELASTIC_", "PL_", "LSB_", "OMPI_", "PMI_")
CLUSTER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "JOB_NAME", "SVC_NAME", "POD_NAMESPACE"}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A throughput comparison: the template and the reference, run the same way."""

    name: str
    processes: int
    glibc_malloc_defaults: bool = False  # True: without REUSE_FREED_MEMORY
    counts_for_target: bool = True


def project_parser(description: str, out: Path) -> argparse.ArgumentParser:
    """The options every benchmark shares: its work directory, and the project and MNIST that `prepare` gives."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=out, help="work and result directory")
    parser.add_argument("--project", type=Path, help="an already generated project (default: generate one)")
    parser.add_argument("--data-dir", type=Path, help="MNIST in torchvision's layout (default: the shipped sample)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = project_parser(__doc__.splitlines()[0], TEMPLATE / "build" / "bench")
    parser.add_argument("--package", default="lightning_mnist", help="its package name (with --project)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each case taking turns in one process")
    # Each process runs faster or slower than the next for its whole life, by up to a third on a
    # virtual machine: only many pairs steady this median, which is why it is not the target's.
    parser.add_argument(
        "--separate-repeats", type=int, default=3, help="pairs of runs of each case in separate processes"
    )
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before the timed window")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps timed")
    parser.add_argument(
        "--turn", type=int, help="steps per turn when the sides take turns (default: 1 on CPU, 10 on a GPU)"
    )
    parser.add_argument("--batch-size", type=int, help="images per process and step (default: the config's)")
    parser.add_argument("--loader-seconds", type=float, default=3.0)
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="on CPU, also measure 1 process with glibc's malloc defaults",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.separate_repeats < 0:
        parser.error("--repeats must be at least 1 and --separate-repeats at least 0")
    return args


def cases(accelerator: str, glibc_malloc_defaults: bool = False) -> list[Case]:
    if accelerator == "gpu":  # NCCL needs a GPU per process
        return [Case("1 process", 1)] + ([Case("2 processes (DDP)", 2)] if torch.cuda.device_count() > 1 else [])
    measured = [Case("1 process", 1), Case("2 processes (DDP)", 2)]
    if glibc_malloc_defaults:
        measured.append(
            Case("1 process, glibc malloc defaults", 1, glibc_malloc_defaults=True, counts_for_target=False)
        )
    return measured


# ---------------------------------------------------------------- running one measurement


class Runner:
    """Starts the measured processes with a clean environment and collects what they write."""

    def __init__(self, args: argparse.Namespace, project: Path, data_dir: Path, accelerator: str) -> None:
        self.args = args
        self.project = project
        self.data_dir = data_dir
        self.accelerator = accelerator
        self.work = args.out / "runs"
        self.logs = args.out / "logs"
        for directory in (self.work, self.logs):
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        self.glibc_default_env = measured_env(project, glibc_malloc_defaults=True)
        self.env = measured_env(project)

    def import_floor(self, name: str, imports: str) -> float:
        """Seconds from starting a process to the end of its imports (not its exit, which takes about a second)."""
        command = [sys.executable, "-c", f"{imports}; import time; print(time.time())"]
        started = self._run(name, command, self.env)
        return float((self.logs / f"{name}.log").read_text().split()[-1]) - started

    def template(self, name: str, case: Case, overrides: list[str] = ()) -> dict:
        """The template's fit alone, timed by `step_timer.StepTimer`."""
        out = self.work / f"{name}.json"
        timer = {"out": str(out), "warmup": self.args.warmup, "steps": self.args.steps}
        started = self._fit(name, case, "step_timer.StepTimer", timer, overrides)
        return self._result(json.loads(out.read_text()), started)

    def interleaved(self, name: str, case: Case, precision: str) -> dict:
        """The template's fit and the plain loop taking turns in the same processes (`interleaved.py`)."""
        out = self.work / f"{name}.json"
        started = self._fit(name, case, "interleaved.InterleavedReference", self._turns(out, precision))
        return self._sides(out, started)

    def lightning_alone(self, name: str, case: Case, precision: str) -> dict:
        """The project's model and data in Lightning's own Trainer, taking turns with the plain loop
        the same way (`lightning_alone.py`); its side is under "template", as in `interleaved`."""
        out = self.work / f"{name}.json"
        command = [
            sys.executable, str(BENCH / "lightning_alone.py"), "--package", self.args.package,
            "--config", "configs/experiment.yaml", "--data-dir", str(self.data_dir),
            "--accelerator", self.accelerator, "--devices", str(case.processes), "--precision", precision,
            "--max-steps", str(self.args.warmup + self.args.steps),
            "--reference", json.dumps(self._turns(out, precision)), *self._batch_size_option("--batch-size"),
        ]  # fmt: skip
        return self._sides(out, self._run(name, command, self._env(case)))

    def _turns(self, out: Path, precision: str) -> dict:
        """`interleaved.InterleavedReference`'s arguments."""
        return {
            "out": str(out), "package": self.args.package, "config": "configs/experiment.yaml",
            "data_dir": str(self.data_dir), "warmup": self.args.warmup, "steps": self.args.steps,
            "turn": self.args.turn, "precision": precision, "batch_size": self.args.batch_size,
        }  # fmt: skip

    def _sides(self, out: Path, started: float) -> dict:
        """Both sides' figures from a run that took turns."""
        sides = json.loads(out.read_text())
        sides["reference"].pop("first_step_wall_time")  # it first runs after the template's warm-up
        return {"template": self._result(sides["template"], started), "reference": sides["reference"]}

    def _fit(self, name: str, case: Case, callback: str, init_args: dict, overrides: list[str] = ()) -> float:
        """Run `train.py fit` with the default config and one more callback; when it was started."""
        callback_config = json.dumps({"class_path": callback, "init_args": init_args})
        command = [
            sys.executable, "train.py", "fit", "--config", "configs/experiment.yaml",
            "--data.data_dir", str(self.data_dir), "--data.download", "false",
            "--trainer.accelerator", self.accelerator, "--trainer.devices", str(case.processes),
            "--trainer.max_steps", str(self.args.warmup + self.args.steps), "--trainer.max_epochs", "-1",
            "--trainer.default_root_dir", str(self.work / name),
            *self._batch_size_option("--data.batch_size"),
            *overrides,
            f"--trainer.callbacks+={callback_config}",
        ]  # fmt: skip
        return self._run(name, command, self._env(case))

    def reference(self, name: str, case: Case, precision: str) -> dict:
        out = self.work / f"{name}.json"
        command = [
            sys.executable, str(BENCH / "reference.py"), "--package", self.args.package,
            "--config", "configs/experiment.yaml", "--data-dir", str(self.data_dir), "--out", str(out),
            "--warmup", str(self.args.warmup), "--steps", str(self.args.steps),
            "--accelerator", self.accelerator, "--precision", precision,
            *self._batch_size_option("--batch-size"),
        ]  # fmt: skip
        if case.processes == 1:
            started = self._run(name, command, self._env(case))
            return self._result(json.loads(out.read_text()), started)
        # Like torchrun: every process gets its rank and the rendezvous address in the environment.
        port, started = free_port(), time.time()
        workers = []
        for rank in range(case.processes):
            env = dict(self._env(case), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.processes),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            log = self.logs / f"{name}-rank{rank}.log"
            with open(log, "w") as output:
                worker = subprocess.Popen(command, cwd=self.project, env=env, stdout=output, stderr=subprocess.STDOUT)
            workers.append((worker, log))
        for worker, log in workers:
            returncode = worker.wait(timeout=600)
            if returncode != 0:
                raise RuntimeError(f"{name} exited {returncode}; the end of {log}:\n{log.read_text()[-3000:]}")
        return self._result(json.loads(out.read_text()), started)

    def loader(self, name: str, streaming_workers: int | None = None) -> dict:
        """The training loader alone: in memory, or streamed from chunks with this many workers."""
        out = self.work / f"{name}.json"
        if streaming_workers is None:
            source = ["--data-dir", str(self.data_dir)]
        else:
            source = ["--chunks", str(self.chunks()), "--workers", str(streaming_workers)]
        command = [
            sys.executable, str(BENCH / "loader.py"), "--package", self.args.package,
            "--config", "configs/experiment.yaml", *source,
            "--out", str(out), "--seconds", str(self.args.loader_seconds), *self._batch_size_option("--batch-size"),
        ]  # fmt: skip
        self._run(name, command, self.env)
        return json.loads(out.read_text())

    def chunks(self) -> Path:
        """The measured data as chunks, written once by the project's own command."""
        chunks = self.args.out / "chunks"
        if not (chunks / "train" / "index.json").exists():
            command = [sys.executable, "-m", "trainkit.chunks",
                       "--config", "configs/experiment.yaml", "--data.data_dir", str(self.data_dir),
                       "--data.download", "false", "--out", str(chunks)]  # fmt: skip
            self._run("chunks", command, self.env)
        return chunks

    def _env(self, case: Case) -> dict[str, str]:
        return self.glibc_default_env if case.glibc_malloc_defaults else self.env

    def _batch_size_option(self, option: str) -> list[str]:
        return [] if self.args.batch_size is None else [option, str(self.args.batch_size)]

    def _run(self, name: str, command: list[str], env: dict[str, str]) -> float:
        """Run to completion; the wall-clock time (`time.time()`) it was started at."""
        log = self.logs / f"{name}.log"
        with open(log, "w") as output:
            started = time.time()
            done = subprocess.run(
                command, cwd=self.project, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=600, check=False
            )
        if done.returncode != 0:
            raise RuntimeError(f"{name} exited {done.returncode}; the end of {log}:\n{log.read_text()[-3000:]}")
        return started

    @staticmethod
    def _result(result: dict, started: float) -> dict:
        """A clock's figures, with the start-up in seconds instead of the first step's wall-clock time."""
        first_step = result.pop("first_step_wall_time")
        return {**result, "startup_s": first_step - started}


def measured_env(project: Path, glibc_malloc_defaults: bool = False) -> dict[str, str]:
    """This process's environment for a measured process: no cluster variables, one torch thread, wandb
    offline, the project and bench/ importable, and malloc keeping freed memory unless `glibc_malloc_defaults`."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_NAMES and not k.startswith(CLUSTER_PREFIXES)}
    for name in REUSE_FREED_MEMORY:
        env.pop(name, None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        WANDB_MODE="offline",  # the default logger, with no network or account
        PYTHONUNBUFFERED="1",
        # Before what the caller set, which may hold the project's dependencies (a machine with no network).
        PYTHONPATH=os.pathsep.join(filter(None, [str(project / "src"), str(BENCH), env.get("PYTHONPATH")])),
    )
    return env if glibc_malloc_defaults else {**env, **REUSE_FREED_MEMORY}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the whole benchmark


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The generated project and the MNIST directory to measure with."""
    sys.path.insert(0, str(TEMPLATE / "scripts"))
    from mnist_sample import write_split

    args.out.mkdir(parents=True, exist_ok=True)
    project = args.project
    if project is None:
        from cookiecutter.main import cookiecutter

        shutil.rmtree(args.out / "project", ignore_errors=True)
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(args.out / "project")))
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = args.out / "data"
        write_split(data_dir, train=8000)
    return project.resolve(), data_dir.resolve()


def measure(args: argparse.Namespace, runner: Runner, measured: list[Case], precision: str) -> dict[str, list]:
    """Every measurement `args.repeats` times, and `args.separate_repeats` pairs in separate processes, in rounds."""
    floors = {"import_floor_s": IMPORT_FLOOR, "import_floor_collector_paused_s": IMPORT_FLOOR_COLLECTOR_PAUSED}
    samples: dict[str, list] = {**{floor: [] for floor in floors}, "loader": []}
    samples.update({f"streaming loader: {workers} workers": [] for workers in STREAMING_WORKERS})
    variants = GPU_VARIANTS if runner.accelerator == "gpu" else {}
    rounds = max(args.repeats, args.separate_repeats)
    for repeat in range(rounds):
        print(f"round {repeat + 1}/{rounds}", flush=True)
        taking_turns, separate = repeat < args.repeats, repeat < args.separate_repeats
        if taking_turns:
            for floor, imports in floors.items():
                samples[floor].append(runner.import_floor(f"{floor.removesuffix('_s')}-{repeat}", imports))
        for number, case in enumerate(measured):
            if taking_turns:
                run = runner.interleaved(f"interleaved-{number}-{repeat}", case, precision)
                samples.setdefault(f"interleaved: {case.name}", []).append(run)
                run = runner.lightning_alone(f"lightning-alone-{number}-{repeat}", case, precision)
                samples.setdefault(f"lightning alone: {case.name}", []).append(run)
            if separate:
                # Alternate which side goes first, so that neither always finds the machine in the same state.
                for side in ("template", "reference")[:: 1 if repeat % 2 == 0 else -1]:
                    name = f"{side}-{number}-{repeat}"
                    run = runner.template(name, case) if side == "template" else runner.reference(name, case, precision)
                    samples.setdefault(f"{side}: {case.name}", []).append(run)
        if taking_turns:
            samples["loader"].append(runner.loader(f"loader-{repeat}"))
            for workers in STREAMING_WORKERS:
                run = runner.loader(f"streaming-loader-{workers}-{repeat}", streaming_workers=workers)
                samples[f"streaming loader: {workers} workers"].append(run)
            for number, (variant, overrides) in enumerate(variants.items()):
                run = runner.template(f"template-gpu-{number}-{repeat}", Case(variant, 1), overrides)
                samples.setdefault(f"template: 1 process, {variant}", []).append(run)
    return samples


def streaming_figures(images_per_s: float, in_memory: float, training: float) -> dict:
    """The streamed loader's images/s, against the in-memory loader's and against what training consumes."""
    return {
        "images_per_s": images_per_s,
        "vs_in_memory": images_per_s / in_memory,
        "vs_training": images_per_s / training,
    }


def overhead_ms(template: dict, reference: dict, images_per_step: int) -> float:
    """What the template side added to each optimizer step over the reference, in ms (negative: it was faster)."""
    return 1000 * images_per_step * (1 / template["images_per_s"] - 1 / reference["images_per_s"])


def turns_overhead_ms(run: dict, images_per_step: int) -> float:
    """`overhead_ms` of a run that took turns (`Runner.interleaved`, `Runner.lightning_alone`)."""
    return overhead_ms(run["template"], run["reference"], images_per_step)


def comparison(templates: list[dict], references: list[dict], images_per_step: int) -> dict:
    """Template against reference, from runs paired one to one: medians of the pairs' ratios."""
    pairs = list(zip(templates, references, strict=True))

    def ratios(field: str) -> list[float]:
        return [template[field] / reference[field] for template, reference in pairs]

    throughput = ratios("images_per_s")
    return {
        "template_images_per_s": median_of(templates, "images_per_s"),
        "reference_images_per_s": median_of(references, "images_per_s"),
        "template_vs_reference": statistics.median(throughput),
        "template_vs_reference_range": [min(throughput), max(throughput)],
        # Less disturbed by other programs than the mean: the steps' median, and CPU time.
        "template_vs_reference_median_step": statistics.median(ratios("images_per_s_median_step")),
        "template_vs_reference_cpu_time": statistics.median(ratios("images_per_cpu_s")),
        # What the template adds to each optimizer step (negative: it was faster).
        "template_overhead_ms_per_step": statistics.median(overhead_ms(*pair, images_per_step) for pair in pairs),
        "page_faults_per_step": {
            "template": median_of(templates, "page_faults_per_step"),
            "reference": median_of(references, "page_faults_per_step"),
        },
    }


def summarise(
    samples: dict[str, list], measured: list[Case], accelerator: str, precision: str, batch_size: int
) -> dict:
    """Medians, and ratios of measurements taken side by side (paired per run, then the median)."""

    def side(key: str, name: str) -> list[dict]:
        return [run[name] for run in samples[key]]

    throughput = {}
    for case in measured:
        interleaved = f"interleaved: {case.name}"
        images_per_step = batch_size * case.processes
        throughput[case.name] = {
            "processes": case.processes,
            "glibc_malloc_defaults": case.glibc_malloc_defaults,
            "counts_for_target": case.counts_for_target,
            **comparison(side(interleaved, "template"), side(interleaved, "reference"), images_per_step),
        }
        lightning = f"lightning alone: {case.name}"
        # The same figures with Lightning alone in the template's place.
        throughput[case.name]["lightning_alone"] = comparison(
            side(lightning, "template"), side(lightning, "reference"), images_per_step
        )
        # Each run's overhead is against the plain loop in its own processes; per round, the
        # template's less Lightning's is what the kit adds.
        throughput[case.name]["kit_overhead_ms_per_step"] = statistics.median(
            turns_overhead_ms(template_run, images_per_step) - turns_overhead_ms(alone_run, images_per_step)
            for template_run, alone_run in zip(samples[interleaved], samples[lightning], strict=True)
        )
        if f"template: {case.name}" in samples:
            throughput[case.name]["separate_processes"] = comparison(
                samples[f"template: {case.name}"], samples[f"reference: {case.name}"], images_per_step
            )
    startups = [run["startup_s"] for run in side("interleaved: 1 process", "template")]
    training = throughput["1 process"]["template_images_per_s"]
    loader = median_of(samples["loader"], "images_per_s")
    results = {
        "machine": {
            "accelerator": accelerator,
            "precision": precision,
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if accelerator == "gpu" else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads_per_process": 1,
            "batch_size_per_process": batch_size,
            "malloc_settings": REUSE_FREED_MEMORY,
        },
        "throughput": throughput,
        "startup": {
            "template_s": statistics.median(startups),
            "reference_s": (
                median_of(samples["reference: 1 process"], "startup_s") if "reference: 1 process" in samples else None
            ),
            "import_floor_s": statistics.median(samples["import_floor_s"]),
            "template_over_floor_s": median_difference(startups, samples["import_floor_s"]),
            "import_floor_collector_paused_s": statistics.median(samples["import_floor_collector_paused_s"]),
            "template_over_collector_paused_floor_s": median_difference(
                startups, samples["import_floor_collector_paused_s"]
            ),
        },
        "loader": {
            "loader_images_per_s": loader,
            "training_images_per_s": training,
            "loader_vs_training": loader / training,
            "streaming": {
                f"{workers} workers": streaming_figures(
                    median_of(samples[f"streaming loader: {workers} workers"], "images_per_s"), loader, training
                )
                for workers in STREAMING_WORKERS
            },
        },
    }
    if "2 processes (DDP)" in throughput:
        results["scaling"] = {
            f"{name}_2p_vs_1p": statistics.median(
                two[name]["images_per_s"] / one[name]["images_per_s"]
                for two, one in zip(
                    samples["interleaved: 2 processes (DDP)"], samples["interleaved: 1 process"], strict=True
                )
            )
            for name in ("template", "reference")
        }
    if accelerator == "gpu":
        results["gpu_images_per_s"] = {f"default ({precision})": training}
        for variant in GPU_VARIANTS:
            results["gpu_images_per_s"][variant] = median_of(samples[f"template: 1 process, {variant}"], "images_per_s")
    results["targets"] = TARGETS
    results["met"] = {
        "template_vs_reference": all(
            case["template_vs_reference"] >= TARGETS["template_vs_reference"]
            for case in throughput.values()
            if case["counts_for_target"]
        ),
        "overhead_ms_per_step_1_process": throughput["1 process"]["template_overhead_ms_per_step"]
        < TARGETS["overhead_ms_per_step_1_process"],
        "overhead_ms_per_step_ddp": all(
            case["template_overhead_ms_per_step"] < TARGETS["overhead_ms_per_step_ddp"]
            for case in throughput.values()
            if case["counts_for_target"] and case["processes"] > 1
        ),
        "loader_vs_training": results["loader"]["loader_vs_training"] >= TARGETS["loader_vs_training"],
        "streaming_vs_training": results["loader"]["streaming"][f"{STREAMING_DEFAULT_WORKERS} workers"]["vs_training"]
        >= TARGETS["streaming_vs_training"],
        "startup_over_floor_s": results["startup"]["template_over_floor_s"] <= TARGETS["startup_over_floor_s"],
    }
    results["samples"] = samples
    return results


def table(results: dict, args: argparse.Namespace) -> str:
    machine, targets = results["machine"], results["targets"]
    gpu = f", {machine['gpu']}" if machine["gpu"] else ""
    lines = [
        (
            f"{machine['accelerator']} ({machine['cpus']} CPUs{gpu}), one torch thread per process,"
            f" batch {machine['batch_size_per_process']} per process, precision {machine['precision']},"
            f" torch {machine['torch']}; steps {args.warmup + 1} to {args.warmup + args.steps} timed"
        ),
        "",
        (
            f"Taking turns in the same processes ({args.turn} step(s) a turn), medians of {args.repeats} runs;"
            f" separate processes: {args.separate_repeats} pairs of runs"
        ),
        (
            f"{'images/s':<34}{'template':>9}{'reference':>10}{'template/reference':>19}{'(range)':>13}"
            f"{'median step':>12}{'CPU time':>9}{'overhead/step':>15}{'separate processes':>20}{'(range)':>13}"
        ),
    ]
    for name, case in results["throughput"].items():
        separate = case.get("separate_processes")
        separate_columns = (
            f"{separate['template_vs_reference']:>20.3f}{span(separate):>13}" if separate else f"{'-':>20}"
        )
        lines.append(
            f"{name:<34}{case['template_images_per_s']:>9.0f}{case['reference_images_per_s']:>10.0f}"
            f"{case['template_vs_reference']:>19.3f}{span(case):>13}"
            f"{case['template_vs_reference_median_step']:>12.3f}{case['template_vs_reference_cpu_time']:>9.3f}"
            f"{case['template_overhead_ms_per_step']:>12.2f} ms{separate_columns}"
        )
        alone = case["lightning_alone"]
        lines.append(
            f"{'  Lightning alone, the same way':<34}{alone['template_images_per_s']:>9.0f}"
            f"{alone['reference_images_per_s']:>10.0f}{alone['template_vs_reference']:>19.3f}{span(alone):>13}"
            f"{alone['template_vs_reference_median_step']:>12.3f}{alone['template_vs_reference_cpu_time']:>9.3f}"
            f"{alone['template_overhead_ms_per_step']:>12.2f} ms"
        )
        lines.append(f"{'  of which the kit':<34}{'':>72}{case['kit_overhead_ms_per_step']:>12.2f} ms")
    if "scaling" in results:
        scaling = results["scaling"]
        template, reference = scaling["template_2p_vs_1p"], scaling["reference_2p_vs_1p"]
        lines.append(f"{'scaling, 1 -> 2 processes':<34}{template:>8.2f}x{reference:>9.2f}x")
    startup, loader = results["startup"], results["loader"]
    reference_startup = f", plain PyTorch {startup['reference_s']:.2f} s" if startup["reference_s"] else ""
    lines += [
        "",
        (
            f"start-up to the first optimizer step: template {startup['template_s']:.2f} s{reference_startup};"
            f" the floor ({IMPORT_FLOOR}) {startup['import_floor_s']:.2f} s;"
            f" template - floor {startup['template_over_floor_s']:+.2f} s"
        ),
        (
            f"  the same imports with the garbage collector paused, as train.py does them:"
            f" {startup['import_floor_collector_paused_s']:.2f} s; template - that floor"
            f" {startup['template_over_collector_paused_floor_s']:+.2f} s"
        ),
        (
            f"train loader alone: {loader['loader_images_per_s']:.0f} images/s, {loader['loader_vs_training']:.0f}x"
            f" what training consumes ({loader['training_images_per_s']:.0f} images/s)"
        ),
        *(
            f"  streamed from chunks, {workers}: {figures['images_per_s']:.0f} images/s,"
            f" {figures['vs_training']:.0f}x training, {figures['vs_in_memory']:.2f}x in memory"
            for workers, figures in loader["streaming"].items()
        ),
    ]
    for variant, images_per_s in results.get("gpu_images_per_s", {}).items():
        lines.append(f"GPU, 1 process, {variant}: {images_per_s:.0f} images/s")
    lines += [
        "",
        (
            f"targets: template/reference >= {targets['template_vs_reference']} taking turns"
            " (every row but a glibc-defaults one), overhead/step"
            f" < {targets['overhead_ms_per_step_1_process']:g} ms on 1 process and"
            f" < {targets['overhead_ms_per_step_ddp']:g} ms under DDP,"
            f" loader >= {targets['loader_vs_training']:g}x training (in memory; streamed with"
            f" {STREAMING_DEFAULT_WORKERS} workers >= {targets['streaming_vs_training']:g}x),"
            f" start-up <= floor + {targets['startup_over_floor_s']:g} s"
        ),
        "met: " + ", ".join(f"{name} {'yes' if met else 'NO'}" for name, met in results["met"].items()),
    ]
    return "\n".join(lines)


def median_of(runs: list[dict], field: str) -> float:
    return statistics.median(run[field] for run in runs)


def median_difference(later: list[float], earlier: list[float]) -> float:
    """The median of the differences between runs of the same round."""
    return statistics.median(a - b for a, b in zip(later, earlier, strict=True))


def span(comparison: dict) -> str:
    low, high = comparison["template_vs_reference_range"]
    return f"({low:.2f}-{high:.2f})"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out = args.out.resolve()
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.turn is None:
        # On a CPU, bursts of a slower machine (about a second here) fall on both sides alike when
        # they change every step. On a GPU each turn ends by waiting for the GPU, which would stop
        # it from running ahead of Python at every step: longer turns keep that as in a real run.
        args.turn = 10 if accelerator == "gpu" else 1
    project, data_dir = prepare(args)
    sys.path.insert(0, str(project / "src"))
    from importlib import import_module

    precision = import_module("trainkit.run.speed").default_precision(accelerator)
    batch_size = args.batch_size or init_args(project / "configs" / "experiment.yaml", "data")["batch_size"]
    runner = Runner(args, project, data_dir, accelerator)
    started = time.monotonic()
    measured = cases(accelerator, args.glibc_malloc_defaults)
    samples = measure(args, runner, measured, precision)
    results = summarise(samples, measured, accelerator, precision, batch_size)
    results["benchmark_seconds"] = time.monotonic() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(table(results, args))
    print(f"\nfigures: {args.out / 'results.json'}; logs: {runner.logs}")
    return results


if __name__ == "__main__":
    main()
