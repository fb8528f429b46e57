"""The example's data converted into chunks (trainkit/chunks.py) and streamed (trainkit/data/streaming.py)."""

import torch
from trainkit.data.streaming import StreamingImageDataModule
from trainkit.testing.training_samples import sample_ids

from {{ cookiecutter.package_name }}.data.mnist import MNISTDataModule


def training_images(mnist_dir, mnist_chunks) -> torch.Tensor:
    """The in-memory training split's images normalised as the streaming path normalises them, to compare ids with."""
    mnist = MNISTDataModule(data_dir=str(mnist_dir), download=False)
    mnist.setup("fit")
    streaming = StreamingImageDataModule(input_dir=str(mnist_chunks))
    return streaming.on_after_batch_transfer(mnist.train_set.tensors, dataloader_idx=0)[0]


def test_mnist_chunks_hold_the_same_splits_as_mnist_in_memory(mnist_dir, mnist_chunks):
    data = StreamingImageDataModule(input_dir=str(mnist_chunks), batch_size=64, num_workers=0)
    assert (data.in_channels, data.num_classes) == (1, 10)  # from the chunks' info/, for the model
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (576, 64)
    streamed = []
    for batch in data.train_dataloader():
        images, _ = batch
        assert images.dtype == torch.uint8 and images.shape[1:] == (1, 28, 28)  # decoded in the workers
        streamed += sample_ids(data.on_after_batch_transfer(batch, dataloader_idx=0)[0])
    assert sorted(streamed) == sorted(sample_ids(training_images(mnist_dir, mnist_chunks)))  # PNG round trip
    data.setup("test")
    assert len(data.test_set) == 160
