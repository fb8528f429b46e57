"""Streaming: chunks written by trainkit.chunks, read by streaming_images.py, shared by processes and workers."""

import json
from collections import Counter

import pytest
import torch

from trainkit.chunks import datasets, facts
from trainkit.data.streaming import StreamingImageDataModule, check_chunks
from trainkit.run.errors import ConfigError
from trainkit.testing.tiny import IMAGE_SIZE, TinyDataModule
from trainkit.testing.training_samples import recorded, sample_ids

from .conftest import streaming_run_args
from .helpers import clean_env, run_chunks, run_train
from .project.tasks.regression import Table


def training_images(tiny_chunks) -> torch.Tensor:
    """The in-memory training split's images normalised as the streaming path normalises them, to compare ids with."""
    tiny = TinyDataModule()
    tiny.setup("fit")
    streaming = StreamingImageDataModule(input_dir=str(tiny_chunks))
    return streaming.on_after_batch_transfer(tiny.train_set.tensors, dataloader_idx=0)[0]


def test_chunks_hold_the_same_splits_as_the_in_memory_path(tiny_chunks):
    data = StreamingImageDataModule(input_dir=str(tiny_chunks), batch_size=64, num_workers=0)
    assert (data.in_channels, data.num_classes) == (1, 4)  # from the chunks' info/, for the model
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (576, 64)
    streamed = []
    for batch in data.train_dataloader():
        images, _ = batch
        assert images.dtype == torch.uint8 and images.shape[1:] == (1, IMAGE_SIZE, IMAGE_SIZE)  # decoded in workers
        streamed += sample_ids(data.on_after_batch_transfer(batch, dataloader_idx=0)[0])
    assert sorted(streamed) == sorted(sample_ids(training_images(tiny_chunks)))  # PNG round trip
    data.setup("test")
    assert len(data.test_set) == 160


def test_converting_leaves_nothing_in_the_temporary_folder(experiment, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "chunks"
    result = run_chunks("--config", str(experiment), "--splits", "[train]", "--out", str(out), "--workers", "1",
                        env=clean_env(TMPDIR=str(scratch)))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["info", "train"]
    assert list(scratch.iterdir()) == []  # litdata's working folders are made there unless told otherwise


def test_the_normalisation_copies_its_statistics_to_the_device_once(tiny_chunks, monkeypatch):
    # A copy from CPU memory to a GPU waits for the GPU: at every batch it would stop the CPU queueing steps ahead.
    data = StreamingImageDataModule(input_dir=str(tiny_chunks))
    on_device = (torch.zeros(2, 1, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8, device="meta"), torch.zeros(2).long())
    data.on_after_batch_transfer(on_device, dataloader_idx=0)  # the meta device stands in for a GPU
    copies, copy = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda tensor, *args, **kwargs: copies.append(args) or copy(tensor, *args))
    images, _ = data.on_after_batch_transfer(on_device, dataloader_idx=0)
    assert images.device.type == "meta" and copies == []


@pytest.mark.slow
def test_one_epoch_on_2_processes_x_2_workers_trains_on_every_sample_once(experiment, tiny_chunks, tmp_path):
    result = run_train(
        "fit", *streaming_run_args(experiment, tiny_chunks, tmp_path / "run"),
        "--trainer.devices", "2", "--data.num_workers", "2", "--trainer.limit_train_batches", "1.0",
        "--trainer.callbacks+=trainkit.testing.training_samples.RecordTrainingSamples",
        "--trainer.callbacks.out_dir", str(tmp_path / "seen"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [recorded(tmp_path / "seen", rank)[0] for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1])  # the same number of steps on every process
    counts = Counter(seen[0] + seen[1])
    assert set(counts.values()) == {1}, f"{sum(count > 1 for count in counts.values())} samples seen twice or more"
    assert sorted(counts) == sorted(sample_ids(training_images(tiny_chunks))), "samples missing"


def damage(chunks, case: str):
    """A copy of the chunk folders with the train folder missing, empty or damaged; the train folder."""
    train = chunks / "train"
    if case == "missing":
        train.rename(chunks / "elsewhere")
    elif case == "empty":
        for path in train.iterdir():
            path.unlink()
    elif case == "damaged index":
        (train / "index.json").write_text('{"chunks": [')
    else:  # a chunk cut short, as by a copy that did not finish
        chunk = train / json.loads((train / "index.json").read_text())["chunks"][0]["filename"]
        chunk.write_bytes(chunk.read_bytes()[:100])
    return train


@pytest.mark.parametrize("case", ["missing", "empty", "damaged index", "truncated chunk"])
def test_a_broken_chunk_folder_is_named_in_one_line(experiment, tiny_chunks, tmp_path, case):
    chunks = tmp_path / "chunks"
    for split in ("info", "train", "val", "test"):
        (chunks / split).mkdir(parents=True)
        for path in (tiny_chunks / split).iterdir():
            (chunks / split / path.name).write_bytes(path.read_bytes())
    train = damage(chunks, case)
    with pytest.raises(ConfigError, match=str(train)):
        check_chunks(str(train))

    result = run_train("fit", *streaming_run_args(experiment, chunks, tmp_path / "run"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(train) in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_data_chunks_cannot_hold_is_refused_in_one_line_naming_it(experiment, tmp_path):
    table = Table()  # a regression's rows and values: no test split, and no images
    with pytest.raises(ConfigError) as no_test:
        datasets(table, ["train", "val", "test"])
    assert str(no_test.value) == "Table defines no test_dataloader: convert the splits it has, --splits [train,val]"
    with pytest.raises(ConfigError, match=r"^Table: train sample 0 is \(float32 tensor of shape \(4,\), .*chunks hold"):
        facts(table, datasets(table, ["train", "val"]))

    # The command says it in one line, exit status 2, and writes nothing.
    out = tmp_path / "chunks"
    result = run_chunks("--config", str(experiment), "--data", "tasks.regression.Table", "--splits", "[train,val]",
                        "--out", str(out), "--workers", "1")  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: Table: train sample 0 is (float32 tensor")
    assert "Traceback" not in result.stderr and not out.exists()
