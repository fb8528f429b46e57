"""Images in class folders (data/image_folder.py), and any image data module made into chunks (trainkit/chunks.py)."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset
from trainkit.chunks import convert, datasets, facts
from trainkit.data.streaming import StreamingImageDataModule
from trainkit.run.errors import ConfigError

from {{ cookiecutter.package_name }}.data.image_folder import ImageFolderDataModule


def write_images(root: Path, split: str, label: str, count: int, mode: str = "RGB", size: tuple[int, int] = (12, 10)):
    """`count` random images of one class, `size` as (width, height)."""
    folder = root / split / label
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        pixels = torch.randint(0, 256, (size[1], size[0], len(mode)), dtype=torch.uint8)
        Image.fromarray(pixels.squeeze(-1).numpy(), mode=mode).save(folder / f"{index}.png")


def image_folder(root: Path, mode: str = "RGB") -> Path:
    for split, count in (("train", 6), ("val", 2), ("test", 3)):
        for label in ("cat", "dog", "emu"):
            write_images(root, split, label, count, mode)
    return root


def test_class_folders_become_labelled_images_with_their_channels_and_statistics(tmp_path):
    data = ImageFolderDataModule(str(image_folder(tmp_path)), batch_size=4)
    assert (data.classes, data.num_classes, data.in_channels) == (["cat", "dog", "emu"], 3, 3)
    data.setup("fit")
    images, labels = data.train_set.tensors
    assert images.shape == (18, 3, 10, 12) and images.dtype == torch.uint8
    assert labels.tolist() == [0] * 6 + [1] * 6 + [2] * 6
    normalised, _ = data.on_after_batch_transfer((images, labels), dataloader_idx=0)
    assert torch.allclose(normalised.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(normalised.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-2)
    assert len(data.val_set) == 6
    data.setup("test")
    assert len(data.test_set) == 9


def test_the_normalisation_copies_its_statistics_to_the_device_once(tmp_path, monkeypatch):
    # A copy from CPU memory to a GPU waits for the GPU: at every batch it would stop the CPU queueing steps ahead.
    data = ImageFolderDataModule(str(image_folder(tmp_path)))
    data.setup("fit")
    on_device = (torch.zeros(2, 3, 10, 12, dtype=torch.uint8, device="meta"), torch.zeros(2).long())
    data.on_after_batch_transfer(on_device, dataloader_idx=0)  # the meta device stands in for a GPU
    copies, copy = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda tensor, *args, **kwargs: copies.append(args) or copy(tensor, *args))
    images, _ = data.on_after_batch_transfer(on_device, dataloader_idx=0)
    assert images.device.type == "meta" and copies == []


def test_channels_and_size_are_converted_when_asked(tmp_path):
    root = image_folder(tmp_path, mode="L")
    write_images(root, "train", "cat", 1, mode="RGBA", size=(20, 30))  # cat/0.png: another size and channels
    data = ImageFolderDataModule(str(root), image_size=(8, 16), channels=3)
    data.setup("fit")
    assert data.train_set.tensors[0].shape == (18, 3, 8, 16)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no root", "does not exist"),
        ("no val", "has no val/ folder"),
        ("no classes", "has no class folders"),
        ("other classes", r"other class folders than train/: missing \['emu'\], extra \['yak'\]"),
        ("no images", "holds no .png or .jpg images"),
        ("a class with no images", r"train/yak holds no .png or .jpg images: add some, or remove the class folder"),
        ("sizes differ", "set data.image_size"),
        ("a damaged image", r"train/dog/0.png cannot be read as an image: image file is truncated"),
        ("colour after gray", r"train/dog/0.png has 3 channels, \S+/train/cat/0.png \(the first training image"),
    ],
)
def test_a_folder_that_does_not_fit_is_named_in_one_line(tmp_path, case, message):
    root = image_folder(tmp_path / "images")
    if case == "no root":
        root = tmp_path / "elsewhere"
    elif case == "no val":
        (root / "val").rename(tmp_path / "val")
    elif case == "no classes":
        (root / "train").rename(tmp_path / "train")
        (root / "train").mkdir()
    elif case == "other classes":
        (root / "test" / "emu").rename(root / "test" / "yak")
    elif case == "no images":
        for path in (root / "train").glob("*/*.png"):
            path.rename(path.with_suffix(".txt"))
    elif case == "a class with no images":
        for split in ("train", "val", "test"):
            (root / split / "yak").mkdir()
    elif case == "sizes differ":
        write_images(root, "train", "dog", 1, size=(7, 7))
    elif case == "a damaged image":
        damaged = root / "train" / "dog" / "0.png"
        damaged.write_bytes(damaged.read_bytes()[:-60])
    else:
        root = image_folder(tmp_path / "gray", mode="L")
        write_images(root, "train", "dog", 1)  # dog/0.png in colour, among gray images: its colours would be lost
    with pytest.raises(ConfigError, match=message) as error:
        ImageFolderDataModule(str(root)).setup("fit")
    assert "\n" not in str(error.value)


def test_hidden_folders_are_no_classes(tmp_path):
    root = image_folder(tmp_path)
    write_images(root, "train", ".ipynb_checkpoints", 1)
    assert ImageFolderDataModule(str(root)).classes == ["cat", "dog", "emu"]


def test_a_folder_of_rgba_images_converts_to_chunks_that_stream_the_same_pixels(tmp_path):
    root = image_folder(tmp_path / "images", mode="RGBA")
    convert(ImageFolderDataModule(str(root)), str(tmp_path / "chunks"), ["train", "val"], workers=1)

    streamed = StreamingImageDataModule(str(tmp_path / "chunks"), num_workers=0)
    assert (streamed.in_channels, streamed.num_classes) == (4, 3)
    in_memory = ImageFolderDataModule(str(root))
    in_memory.setup("fit")
    assert torch.allclose(streamed.mean, in_memory.mean) and torch.allclose(streamed.std, in_memory.std)
    streamed.setup("fit")
    pairs = sorted((image.numpy().tobytes(), label) for image, label in streamed.train_set)
    images, labels = in_memory.train_set.tensors
    assert pairs == sorted((image.numpy().tobytes(), int(label)) for image, label in zip(images, labels, strict=True))


class FloatSamples(LightningDataModule):
    """A data module whose samples are float vectors, not images."""

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.size = size

    def setup(self, stage: str) -> None:
        self.dataset = TensorDataset(torch.rand(self.size, 5), torch.zeros(self.size, dtype=torch.long))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset)

    val_dataloader = test_dataloader = train_dataloader


def test_a_data_module_without_images_is_refused_naming_its_samples():
    samples = FloatSamples()
    with pytest.raises(ConfigError) as refused:
        facts(samples, datasets(samples, ["train", "val"]))
    assert str(refused.value) == (
        "FloatSamples: train sample 0 is (float32 tensor of shape (5,), int64 tensor of shape ());"
        " chunks hold (image, label) pairs: a uint8 tensor (channels, height, width) and an integer class"
    )


def test_an_empty_split_is_refused():
    with pytest.raises(ConfigError, match="FloatSamples: the train dataset is empty"):
        datasets(FloatSamples(size=0), ["train", "val"])
