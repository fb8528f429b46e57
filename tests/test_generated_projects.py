"""Each generated project's own test suite passes, and the default project learns real MNIST digits."""

import subprocess
import sys

import pytest

from .conftest import ANSWER_SETS, TEMPLATE


ANSWER_DEPENDENT_TESTS = [
    "tests/test_model.py",
    "tests/test_cluster.py",
    "tests/test_cli.py::test_fit_trains_saves_checkpoints_and_reruns_in_the_same_directory",
    "tests/test_cli.py::test_print_config_is_complete_and_reusable",
]


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_generated_test_suite_passes(projects, answer_set):
    # The whole suite runs for the defaults. Other answers change names (package, project, wandb
    # project), not behaviour: their units, a fit and a rerun, and the printed config run again.
    selection = [] if answer_set == "defaults" else ANSWER_DEPENDENT_TESTS
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        cwd=projects[answer_set],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_demo_trains_to_95_percent_on_real_digits(default_project, real_mnist, tmp_path):
    sys.path.insert(0, str(TEMPLATE / "scripts"))
    from demo import MIN_ACCURACY, train_and_test

    accuracy = train_and_test(default_project, real_mnist, tmp_path / "run")
    assert accuracy >= MIN_ACCURACY
