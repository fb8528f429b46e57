import torch
from torch.optim.lr_scheduler import StepLR

from {{ cookiecutter.package_name }}.model import ConvNet, MNISTClassifier

from .conftest import fake_digits


def normalised_batch(count: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = fake_digits(count, seed=0)
    return images.unsqueeze(1).float() / 255, labels.long()


def test_convnet_returns_logits_per_class():
    logits = ConvNet()(torch.zeros(5, 1, 28, 28))
    assert logits.shape == (5, 10)


def test_training_step_returns_scalar_loss():
    model = MNISTClassifier()
    loss = model.training_step(normalised_batch(), batch_idx=0)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = MNISTClassifier(dropout=0.0)
    optimizer = model.configure_optimizers()
    batch = normalised_batch(64)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = model.training_step(batch, batch_idx=0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_and_scheduler_are_injected():
    model = MNISTClassifier(
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.1),
    )
    configured = model.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.SGD)
    assert configured["optimizer"].param_groups[0]["lr"] == 0.5
    assert isinstance(configured["lr_scheduler"], StepLR)


def test_predict_step_gives_class_and_confidence():
    model = MNISTClassifier().eval()
    images, labels = normalised_batch(8)
    with torch.no_grad():
        out = model.predict_step((images, labels), batch_idx=0)
    assert out["predicted"].shape == (8,) and out["predicted"].max() < 10
    assert ((out["confidence"] > 0) & (out["confidence"] <= 1)).all()
    assert torch.equal(out["label"], labels)
