"""The kit's guarantees, put to a project's own model and data: tests that run on whatever the experiment names.

A project's tests subclass `YourCodeContract` once (tests/test_your_code.py), or once per model and data pair:

    class TestTheExperiment(YourCodeContract):
        project = PROJECT_ROOT                           # where train.py is
        args = ("--config", "configs/experiment.yaml")  # the model and data, as train.py is told them

The fast tests run in the default `pytest`: a short real `train.py fit`, then validate, test and predict in the
test's own process, seconds each. The drills (`pytest -m drills`, a few minutes) interrupt real runs of 1 and 2
processes. A failure names the broken guarantee and the reason in its first line.
"""

import json
import math
import re
import signal
import sys
import warnings
from contextlib import chdir
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import pytest
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.model_helpers import is_overridden

from trainkit.cli import ProjectCLI
from trainkit.run.config import class_of, configured
from trainkit.run.config_errors import OneLineErrorParser
from trainkit.run.researchers_code import raised_in, researchers_file
from trainkit.testing.runs import clean_env, exit_code, paced, run_train, signal_at, start_train, wait_for
from trainkit.tracking.predictions import PredictionWriter

# How the kit's own lines begin: a monitored metric the model does not log (checkpoints/best.py), a training
# loader that cannot resume mid-epoch (data/resumable.py), a stop by SIGTERM (checkpoints/preemption.py).
MONITOR_NOT_LOGGED = "best_checkpoint.monitor:"
EXACT_RESUME = "exact resume:"
PREEMPTION_SAVED = "SIGTERM: saved "
# Why a resumed run most often trains otherwise, where the kit said nothing of its loaders.
NOT_IN_THE_CHECKPOINT = (
    "training depends on state the checkpoint does not keep: a plain attribute that changes as it trains (keep it"
    " in a registered buffer, or in on_save_checkpoint and on_load_checkpoint), or random numbers not drawn from"
    " torch's, random's or NumPy's global generators"
)
# Why a resumed run trains otherwise where the project has epoch-end hooks (checkpoints/epoch_end.py).
SKIPPED_AT_AN_EPOCHS_LAST_STEP = (
    "at each epoch's end, and a run stopped at an epoch's last step resumes with the next epoch, without that"
    " epoch's end hooks: set what training depends on from self.current_epoch in on_train_epoch_start instead"
    " (docs/checkpoints.md)"
)
# A frame of a Python traceback in a run's output, stripped.
TRACEBACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
# What each stage runs: the model's step, and the loader the data module (or the model) gives.
STAGES = {
    "validate": ("validation_step", "val_dataloader"),
    "test": ("test_step", "test_dataloader"),
    "predict": ("predict_step", "predict_dataloader"),
}


@dataclass
class Run:
    """A `train.py` run that ended: its directory and what it printed."""

    dir: Path
    returncode: int
    output: str

    @property
    def last_ckpt(self) -> Path:
        return self.dir / "checkpoints" / "last.ckpt"

    def report(self, rank: int = 0) -> dict:
        """What process `rank` saw at the end of fit (testing/rank_report.py): its step, a digest of the weights."""
        return json.loads((self.dir / "ranks" / f"rank{rank}.json").read_text())

    def weights(self, rank: int = 0) -> str:
        return self.report(rank)["weights"]


class YourCodeContract:
    project: Path
    args: tuple[str, ...] = ("--config", "configs/experiment.yaml")
    steps_per_epoch: int = 8  # training steps of each quick epoch, per process
    sharded_config: str = "configs/strategy/fsdp.yaml"

    run_args: tuple[str, ...]  # `args` and what `prepare` adds

    @classmethod
    def prepare(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
        """Arguments the tests add to `args`, such as data made for them (the example's fake digits); none here."""
        return ()

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def prepared(cls, tmp_path_factory: pytest.TempPathFactory) -> None:
        cls.run_args = (*cls.args, *cls.prepare(tmp_path_factory))

    # ---- fast: the default pytest

    @pytest.fixture(scope="class")
    @classmethod
    def fitted(cls, prepared: None, tmp_path_factory: pytest.TempPathFactory) -> Run:
        """One quick training run, which the fast tests share."""
        return cls().fit(tmp_path_factory.mktemp("fitted"))

    def test_a_few_steps_train_validate_and_save_last_ckpt_every_epoch(self, fitted: Run) -> None:
        assert fitted.returncode == 0, (
            f"training: train.py fit ended with exit {fitted.returncode}: {why(fitted, self.project)}"
        )
        assert fitted.last_ckpt.exists(), "resume: no last.ckpt after two epochs, a restarted job would start afresh"

    def test_the_monitored_metric_is_one_the_model_logs(self, fitted: Run) -> None:
        trained(fitted)
        said = said_lines(fitted, MONITOR_NOT_LOGGED)
        assert not said, said[0] if said else ""

    def test_the_training_loader_resumes_mid_epoch(self, fitted: Run) -> None:
        trained(fitted)
        said = said_lines(fitted, EXACT_RESUME)
        assert not said, said[0] if said else ""

    def test_a_checkpoint_loads_back_to_the_same_validation(self, fitted: Run, tmp_path: Path) -> None:
        trained(fitted)
        model, data = self.build()
        if not defines(model, data, "validate"):
            pytest.skip("the model validates nothing (no validation_step or no validation data)")
        other, _ = self.build("--seed_everything", "12345")  # initialised otherwise: only the checkpoint agrees
        results = []
        for each in (model, other):
            seed_everything(0)  # loaders that draw their samples draw the same ones
            results.append(self.evaluate("validate", each, data, fitted.last_ckpt, tmp_path, verbose=False))
        scores = [value for result in results[0] for value in result.values()]
        assert all(math.isfinite(value) for value in scores), (
            f"training: validating last.ckpt gives {results[0]}: after the quick fit the model's scores are not finite"
        )
        assert results[0] == results[1], (
            f"save and load: validating last.ckpt gives {results[0]} in one model and {results[1]} in another"
            " initialised otherwise: some of the model's state is not saved in its checkpoint (keep tensors in"
            " registered parameters or buffers)"
        )

    @pytest.mark.parametrize("stage", ["test", "predict"])  # validate: the test above
    def test_test_and_predict_run_where_the_model_defines_them(self, fitted: Run, tmp_path: Path, stage: str) -> None:
        trained(fitted)
        model, data = self.build()
        if not defines(model, data, stage):
            pytest.skip(f"the model or data defines no {' or '.join(STAGES[stage])}")
        self.evaluate(stage, model, data, fitted.last_ckpt, tmp_path)
        if stage == "predict":
            assert len((tmp_path / "predictions.csv").read_text().splitlines()) > 1, "predict: no rows written"

    # ---- drills: pytest -m drills

    @pytest.mark.drills
    @pytest.mark.parametrize("processes", [1, 2], ids=["1-process", "2-processes"])  # `-k 2-processes`: no spaces
    def test_sigterm_at_an_epochs_end_then_mid_epoch_then_the_same_command_trains_the_same_weights(
        self, tmp_path: Path, processes: int
    ):
        self.drill(tmp_path, "--trainer.devices", str(processes))

    @pytest.mark.drills
    def test_sharded_on_2_processes_sigterm_then_the_same_command_trains_the_same_weights(self, tmp_path: Path):
        model, _ = self.build()
        if not is_overridden("configure_model", model):
            pytest.skip("the model does not shard (no configure_model): DDP is the way for it")
        self.drill(tmp_path, "--config", self.sharded_config, "--trainer.devices", "2")

    # ---- how

    def quick(self, run_dir: Path, *extra: str) -> list[str]:
        """The project's args for two short epochs on the CPU, each process reporting its weights. The project's own
        logger logs: a model may call its API (`self.logger.experiment`) without checking that there is one."""
        return [
            *self.run_args,
            "--trainer.accelerator", "cpu",
            "--trainer.sync_batchnorm", "false",  # torch's SyncBatchNorm runs on GPUs only; batch norm stays
            "--trainer.max_epochs", "2",
            "--trainer.max_steps", "-1",
            "--trainer.limit_train_batches", str(self.steps_per_epoch),
            "--trainer.limit_val_batches", "2",
            "--trainer.val_check_interval", str(self.quick_val_check_interval()),
            "--trainer.default_root_dir", str(run_dir),
            "--trainer.enable_progress_bar", "false",
            *extra,
            "--trainer.callbacks+=trainkit.testing.rank_report.ReportRank",
            "--trainer.callbacks.out_dir", str(run_dir / "ranks"),
        ]  # fmt: skip

    def quick_val_check_interval(self) -> float | int:
        """The project's `trainer.val_check_interval` where it fits a quick epoch (a fraction of it, or as many steps or
        fewer), so that validation within an epoch is tried too; otherwise once an epoch: every `steps_per_epoch`
        steps where the project validates by steps across epochs (`check_val_every_n_epoch: null`)."""
        trainer = self.command_line(parse_only=True).config.trainer
        configured = trainer.val_check_interval
        if isinstance(configured, float) and 0 < configured < 1:
            return configured
        if isinstance(configured, int) and 0 < configured <= self.steps_per_epoch:
            return configured
        return self.steps_per_epoch if trainer.check_val_every_n_epoch is None else 1.0

    def fit(self, run_dir: Path, *extra: str, wandb_mode: str = "offline") -> Run:
        """A quick run; wandb logs `offline` (the quick fit: what the model logs is written), or is `disabled`."""
        env = clean_env(WANDB_MODE=wandb_mode)
        result = run_train(self.project, "fit", *self.quick(run_dir, *extra), env=env, timeout=600)
        return Run(run_dir, result.returncode, result.stdout + result.stderr)

    def build(self, *extra: str) -> tuple[LightningModule, LightningDataModule | None]:
        """The model and data module as train.py makes them from the project's args, in this process."""
        built = self.command_line(*extra)
        return built.model, built.datamodule

    def command_line(self, *extra: str, parse_only: bool = False) -> "_ModelAndDataOnly":
        """train.py's command line on the project's args, in this process: the model and data module made, unless
        `parse_only`."""
        command_line = _ConfigOnly if parse_only else _ModelAndDataOnly
        with chdir(self.project), patch.object(sys, "argv", ["train.py"]):  # pytest's own arguments are not train.py's
            return command_line(
                LightningModule, None, subclass_mode_model=True, subclass_mode_data=True,
                save_config_callback=None, parser_class=OneLineErrorParser, run=False,
                args=[*self.run_args, "--trainer.logger", "false", *extra],
            )  # fmt: skip

    def evaluate(
        self, stage: str, model: LightningModule, data: LightningDataModule | None, ckpt: Path, out_dir: Path, **kwargs
    ) -> list | None:
        """Two batches of `stage` (validate, test or predict) on the CPU from `ckpt`, predictions written to `out_dir`.
        An error of the model or data fails the test in one line: the error, where, and for a loader a likely why."""
        __tracebackhide__ = True  # a failure shows the test's line and its message, not this code
        # Lightning asks for the callbacks that saved the checkpoint: what is evaluated here is the model's own.
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
        trainer = Trainer(
            accelerator="cpu", devices=1, logger=DummyLogger(), enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
            callbacks=[PredictionWriter(str(out_dir))], default_root_dir=out_dir,
        )  # fmt: skip
        try:
            return getattr(trainer, stage)(model, datamodule=data, ckpt_path=ckpt, **kwargs)
        except Exception as error:
            function, where = raised_in(error, self.project)
            likely = ""
            if function.endswith(f".{STAGES[stage][1]}"):  # the stage's loader: its data was never made
                likely = f": Lightning calls setup('{stage}') before {stage}, and setup('fit') only before fit"
            raise AssertionError(
                f"{stage}: Trainer.{stage} on last.ckpt raised {type(error).__name__}: {error} (in {function},"
                f" {where}){likely}"
            ) from error

    def drill(self, tmp_path: Path, *extra: str) -> None:
        """SIGTERM at the first epoch's last step, then in the middle of the second epoch, each ending the run with
        143, then the same command: the uninterrupted weights. A checkpoint of an epoch's last step is the one
        Lightning alone resumes wrong (checkpoints/epoch_end.py); the second stop is sent as a platform sends it."""
        __tracebackhide__ = True  # a failure shows the test's line and its message, not this code
        whole = self.fit(tmp_path / "uninterrupted", *extra, wandb_mode="disabled")
        assert whole.returncode == 0, (
            f"training: train.py fit ended with exit {whole.returncode}: {why(whole, self.project)}"
        )
        processes = len(list((whole.dir / "ranks").glob("rank*.json")))
        digests = {whole.weights(rank) for rank in range(processes)}
        assert len(digests) == 1, f"agreement: the {processes} processes ended with different weights"

        steps_per_epoch = whole.report()["global_step"] // 2  # fewer than asked where the data has fewer batches
        assert steps_per_epoch > 1, (
            f"exact resume: the data gives {steps_per_epoch} batch per epoch and process, too few to stop mid-epoch:"
            " give the tests a smaller batch size (`prepare`)"
        )
        run_dir, marker, log = tmp_path / "interrupted", tmp_path / "mid-epoch", tmp_path / "interrupted.log"
        # The second epoch's first step: processes stop together at a step a few steps after the signal.
        at_step = steps_per_epoch + 1
        command = ["fit", *self.quick(run_dir, *extra), *paced(marker, at_step)]
        env = clean_env(WANDB_MODE="disabled")  # the model's logging calls run, and nothing is written
        at_epoch_end = run_train(self.project, *command, *signal_at(steps_per_epoch), env=env, timeout=600)
        stopped = Run(run_dir, at_epoch_end.returncode, at_epoch_end.stdout + at_epoch_end.stderr)
        assert stopped.returncode == 143, (
            f"preemption: SIGTERM at step {steps_per_epoch}, the first epoch's last, ended the run with exit"
            f" {stopped.returncode}, not 143: {why(stopped, self.project)}"
        )

        job = start_train(self.project, command, env, log)
        wait_for(marker, job, log, timeout=300)
        job.send_signal(signal.SIGTERM)  # as a platform stops a node: to its first process
        code = exit_code(job, timeout=120, hang="preemption: SIGTERM did not end the run within 120 s")
        interrupted = Run(run_dir, code, log.read_text())
        assert code == 143, (
            f"preemption: SIGTERM ended the run with exit {code}, not 143: {why(interrupted, self.project)}"
        )
        stopped_at = stopped_step(interrupted, self.project)
        assert stopped_at % steps_per_epoch, (
            f"exact resume: not tried, as the SIGTERM after step {at_step} stopped the run at step {stopped_at}, the"
            f" end of an epoch of {steps_per_epoch} steps: give the tests more steps per epoch (a smaller batch size"
            " in `prepare`, or a larger `steps_per_epoch`)"
        )

        again = run_train(self.project, *command, env=env, timeout=600)
        rerun = Run(run_dir, again.returncode, again.stdout + again.stderr)
        assert rerun.returncode == 0, (
            f"resume: the same command ended with exit {rerun.returncode}: {why(rerun, self.project)}"
        )
        if rerun.weights() != whole.weights():
            said = [line.removeprefix(EXACT_RESUME).strip() for run in (stopped, interrupted, rerun)
                    for line in said_lines(run, EXACT_RESUME)]  # fmt: skip
            hooks = self.epoch_end_hooks()
            likely = said[0] if said else NOT_IN_THE_CHECKPOINT
            if hooks and not said:
                runs = "runs" if len(hooks) == 1 else "run"
                likely = f"{' and '.join(hooks)} {runs} {SKIPPED_AT_AN_EPOCHS_LAST_STEP}; or {likely}"
            raise AssertionError(
                f"exact resume: after SIGTERM at steps {steps_per_epoch} and {at_step} and the same command again, the"
                f" weights differ from an uninterrupted run's; {likely}"
            )

    def epoch_end_hooks(self) -> list[str]:
        """The project's own `on_train_epoch_end` hooks: its model's and its callbacks' (not Lightning's, the kit's)."""
        built = self.command_line()
        model = built.model
        own_callbacks = model.configure_callbacks()  # one callback or several
        own_callbacks = [own_callbacks] if isinstance(own_callbacks, Callback) else list(own_callbacks)
        owners = [model, *own_callbacks, *built.callback_classes]
        return [
            f"{_name(owner)}.on_train_epoch_end"
            for owner in owners
            if _projects_own(owner) and is_overridden("on_train_epoch_end", owner, parent=_lightning_base(owner))
        ]


class _ModelAndDataOnly(ProjectCLI):
    """train.py's command line, making only the model and the data module (and no Trainer, no run directory)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--ckpt_path", type=str | None, help="(a training setting; not used here)")

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        built = self.parser.instantiate_classes(self.config)
        self.model, self.datamodule = built.model, built.get("data")
        # The classes only: a callback may do things when it is made (open files, start threads).
        self.callback_classes = [
            class_of(callback.class_path) for callback in configured(self.config.trainer.callbacks)
        ]


class _ConfigOnly(_ModelAndDataOnly):
    """train.py's command line, parsing the project's args only."""

    def instantiate_classes(self) -> None:
        pass


def _name(owner: object) -> str:
    return owner.__name__ if isinstance(owner, type) else type(owner).__name__


def _projects_own(owner: object) -> bool:
    module = (owner if isinstance(owner, type) else type(owner)).__module__
    return module.partition(".")[0] not in ("lightning", "pytorch_lightning", "trainkit")


def _lightning_base(owner: object) -> type:
    return LightningModule if isinstance(owner, LightningModule) else Callback


def trained(fitted: Run) -> None:
    if fitted.returncode != 0 or not fitted.last_ckpt.exists():
        pytest.skip("the quick training failed: its own test says why")


def defines(model: LightningModule, data: LightningDataModule | None, stage: str) -> bool:
    step, loader = STAGES[stage]
    return is_overridden(step, model) and is_overridden(loader, data if data is not None else model)


def said_lines(run: Run, start: str) -> list[str]:
    """The lines of a run's output that say `start`, from there on (a warning's file and line are cut)."""
    return [line[line.index(start) :] for line in run.output.splitlines() if start in line]


def stopped_step(run: Run, project: Path) -> int:
    """The step at which SIGTERM stopped a run, from the line the preemption checkpoint logs."""
    __tracebackhide__ = True  # a failure shows the test's line and its message, not this code
    said = said_lines(run, PREEMPTION_SAVED)
    assert said, f"preemption: the run said nothing like {PREEMPTION_SAVED!r}: {why(run, project)}"
    return int(re.search(r" at step (\d+)", said[0]).group(1))


def why(run: Run, project: Path) -> str:
    """The last line that says what went wrong, for a failure's first line; after a traceback, where in the
    researcher's code it was raised."""
    lines = [line.strip() for line in run.output.splitlines() if line.strip() and not line.startswith("wandb")]
    errors = [index for index, line in enumerate(lines) if line.startswith("error:") or "Error" in line
              or "Exception" in line]  # fmt: skip
    if not errors:
        return (lines or ["(no output)"])[-1]
    where = raised_in_output(lines[: errors[-1]], project)
    return f"{lines[errors[-1]]} ({where})" if where else lines[errors[-1]]


def raised_in_output(lines: list[str], project: Path) -> str | None:
    """`in FUNCTION, FILE:LINE`: the deepest frame in the researcher's code (the project's, not train.py or the
    kit) of the traceback these lines end with; None where there is none."""
    tracebacks = [index for index, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    for line in reversed(lines[tracebacks[-1] :] if tracebacks else []):
        frame = TRACEBACK_FRAME.fullmatch(line)
        if frame is None:
            continue
        path = project / frame["file"]  # a file named relative to the run's folder, the project, is in it
        if researchers_file(path, project):
            return f"in {frame['function']}, {path.relative_to(project)}:{frame['line']}"
    return None
