"""Each generated project's own test suite passes, and the default project learns real MNIST digits."""

import subprocess
import sys

import pytest

from .conftest import ANSWER_SETS, TEMPLATE


@pytest.mark.parametrize("answer_set", ANSWER_SETS)
def test_generated_test_suite_passes(projects, answer_set):
    # The slow tests (multi-process runs, failure drills) depend on no answer but the package
    # name: the whole suite runs for the defaults, the rest of it for every other answer set.
    selection = [] if answer_set == "defaults" else ["-m", "not slow"]
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
