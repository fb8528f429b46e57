"""What a fit needs of the machine (trainkit/run/machine.py): a compiler for a compiled model, and /dev/shm enough
for NCCL and the loader workers, checked as the fit starts."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader

from trainkit.run.compiler import compile_problem, compiled_modules, missing_compiler
from trainkit.run.errors import ConfigError
from trainkit.run.machine import CheckThisMachine
from trainkit.run.shared_memory import shared_memory_warning, size_of
from trainkit.testing.tiny import TinyClassifier, TinyDataModule

from .helpers import clean_env, quick_run_args, run_train
from .project.tasks.compiled import CompiledClassifier

MIB = 1 << 20
DOCKER_DEFAULT = 64 * MIB  # a container's /dev/shm unless its platform sets it


def quick_trainer(**settings) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[CheckThisMachine()],
                   **settings)  # fmt: skip


# ---- /dev/shm ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "workers", "users"),
    [
        (8, 0, "NCCL between this node's 8 GPUs"),
        (0, 1, "1 data loader worker per process"),
        (2, 4, "NCCL between this node's 2 GPUs and 4 data loader workers per process"),
    ],
)
def test_a_node_short_of_shared_memory_is_told_what_to_set(gpus, workers, users):
    warning = shared_memory_warning(DOCKER_DEFAULT, gpus, workers)
    assert warning == (
        f"/dev/shm has only 64 MiB, too little for {users}: give the container 16 GB or more"
        " (docker run --shm-size=16g; launch/<platform>/README.md says how)"
    )


@pytest.mark.parametrize(
    ("size", "gpus", "workers"),
    [
        (1 << 30, 8, 4),  # 1 GiB: enough
        (16 << 30, 8, 4),
        (DOCKER_DEFAULT, 1, 0),  # one GPU, no workers: nothing uses it
        (DOCKER_DEFAULT, 0, 0),
        (None, 8, 4),  # no /dev/shm at all (macOS)
    ],
)
def test_enough_shared_memory_or_nothing_that_uses_it_says_nothing(size, gpus, workers):
    assert shared_memory_warning(size, gpus, workers) is None


def test_the_size_is_the_file_systems(tmp_path):
    assert size_of(tmp_path) > 0
    assert size_of(tmp_path / "missing") is None


def stub_trainer(local_rank: int, device: str, devices: int, loaders: object) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device(device))
    return SimpleNamespace(local_rank=local_rank, num_devices=devices, world_size=devices, strategy=strategy,
                           train_dataloader=loaders)  # fmt: skip


@pytest.mark.parametrize(
    ("local_rank", "device", "devices", "loaders", "expected"),
    [
        (0, "cuda", 8, None, "NCCL between this node's 8 GPUs"),
        (1, "cuda", 8, None, None),  # the node's other processes say nothing
        (0, "cpu", 2, None, None),  # gloo's processes talk over sockets
        (0, "cpu", 1, {"a": DataLoader([0], num_workers=0), "b": [DataLoader([0], num_workers=2)]}, "2 data loader"),
    ],
)
def test_the_first_process_of_a_node_warns_for_its_gpus_and_workers(
    monkeypatch, caplog, local_rank, device, devices, loaders, expected
):
    monkeypatch.setattr("trainkit.run.machine.size_of", lambda path: DOCKER_DEFAULT)
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        CheckThisMachine().on_train_start(stub_trainer(local_rank, device, devices, loaders), TinyClassifier())
    warnings = [record.getMessage() for record in caplog.records]
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and expected in warnings[0] and "\n" not in warnings[0]


def test_a_fit_with_loader_workers_warns_once_as_training_starts(monkeypatch, caplog):
    monkeypatch.setattr("trainkit.run.machine.size_of", lambda path: DOCKER_DEFAULT)
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        quick_trainer(limit_val_batches=0).fit(TinyClassifier(), TinyDataModule(num_workers=1))
    warnings = [record.getMessage() for record in caplog.records if record.name.startswith("trainkit")]
    assert warnings == [
        "/dev/shm has only 64 MiB, too little for 1 data loader worker per process: give the container 16 GB or"
        " more (docker run --shm-size=16g; launch/<platform>/README.md says how)"
    ]


# ---- torch.compile needs a compiler -----------------------------------------------------------


def tiny_network() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))


def test_compiled_modules_are_found_however_they_were_compiled():
    assert compiled_modules(tiny_network()) == []
    in_place = tiny_network()
    in_place[2].compile()  # nn.Module.compile(), as the example model does
    assert compiled_modules(in_place) == ["2"]
    wrapped = nn.ModuleDict({"encoder": torch.compile(tiny_network()), "head": nn.Linear(2, 2)})
    assert compiled_modules(wrapped) == ["encoder"]
    whole = tiny_network()
    whole.compile()
    assert compiled_modules(whole) == [""]


@pytest.fixture
def no_compiler(monkeypatch):
    for variable in ("CC", "CXX"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", "")


def test_without_a_compiler_a_compiled_model_is_refused_in_one_line(no_compiler):
    network = tiny_network()
    network[2].compile()
    assert compile_problem(network, "cpu") == (
        "model.2 is compiled (torch.compile), which builds code with a C compiler while training, and this machine"
        " has none ($CXX, then g++ on PATH): build the image with --build-arg COMPILER=1 (Dockerfile), install gcc"
        " and g++, or train uncompiled"
    )
    assert "($CC, then gcc or clang on PATH)" in compile_problem(network, "cuda")  # Triton's search
    assert compile_problem(tiny_network(), "cpu") is None  # nothing compiled: nothing needed


def test_a_compiler_named_by_its_variable_must_exist(monkeypatch):
    monkeypatch.setenv("CC", "/nowhere/clang")
    monkeypatch.setenv("CXX", "/nowhere/g++")
    assert missing_compiler("cuda") == "$CC (/nowhere/clang)"
    assert missing_compiler("cpu") == "$CXX (/nowhere/g++)"
    assert missing_compiler("mps") is None  # no compiler torch is known to look for there


def test_with_a_compiler_a_compiled_model_may_train(tmp_path, monkeypatch):
    for variable in ("CC", "CXX"):
        monkeypatch.delenv(variable, raising=False)
    compiler = tmp_path / "g++"  # only found, never run by the check
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    (tmp_path / "gcc").symlink_to(compiler)
    monkeypatch.setenv("PATH", str(tmp_path))
    network = tiny_network()
    network.compile()
    assert compile_problem(network, "cpu") is None
    assert compile_problem(network, "cuda") is None


def test_a_fit_stops_before_its_first_compiled_step(no_compiler):
    """The researcher's module is checked, not the strategy's wrapper, after configure_model compiled it and before
    the sanity check would run the compiled network."""
    model = CompiledClassifier()
    trainer = quick_trainer(num_sanity_val_steps=2)
    with pytest.raises(ConfigError, match=r"^model\.net is compiled \(torch\.compile\)"):
        trainer.fit(model, TinyDataModule())
    assert trainer.global_step == 0


def test_train_py_refuses_a_compiled_model_without_a_compiler_in_one_line(experiment, tmp_path):
    # The compiler that inductor would build the CPU code with is missing.
    result = run_train(
        "fit", *quick_run_args(experiment, tmp_path / "run"), "--model", "tasks.compiled.CompiledClassifier",
        env=clean_env(CXX=str(tmp_path / "no-g++")),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "Error" in line or line.startswith("error:")]
    assert errors == [
        f"error: model.net is compiled (torch.compile), which builds code with a C compiler while training, and this"
        f" machine has none ($CXX ({tmp_path / 'no-g++'})): build the image with --build-arg COMPILER=1"
        " (Dockerfile), install gcc and g++, or train uncompiled"
    ], result.stderr[-3000:]
    assert not Path(tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
