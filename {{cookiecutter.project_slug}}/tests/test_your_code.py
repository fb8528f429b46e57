"""Your model and data, as `configs/experiment.yaml` names them, put through the kit's guarantees
(src/trainkit/testing/contract.py): `pytest` runs the quick tests, `pytest -m drills` interrupts real runs.
Each failure's first line names the guarantee that broke and why."""

import pytest
from trainkit.testing.contract import YourCodeContract

from .conftest import PROJECT_ROOT


class TestTheExperiment(YourCodeContract):
    project = PROJECT_ROOT
    args = ("--config", "configs/experiment.yaml")

    # The example's digits download where there is a network; the tests train on small fake ones.
    # Once the experiment names your data: point this at a small sample of it, or delete it where the data is at hand.
    @classmethod
    def prepare(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
        from .example.fake_mnist import write_fake_mnist  # here, so that deleting this method leaves no trace of it

        digits = write_fake_mnist(tmp_path_factory.mktemp("mnist"))
        # Batches of 32: 8 steps in each quick epoch on 2 processes too, so that the drills can stop mid-epoch.
        return ("--data.data_dir", str(digits), "--data.download", "false", "--data.batch_size", "32")


# Another model and data pair of yours: a class like the one above, its `args` adding
# "--model", "configs/model/<yours>.yaml", "--data", "configs/data/<yours>.yaml".
