"""Make it yours, for a task unlike the example's: the generated README's steps followed for a character-level
language model on text files (the project's own docs/*.md). New files (a model, a data module, their configs),
the experiment repointed, the example deleted: then the project's whole default test suite passes (its configs,
and its model and data through the kit's contract), and `predict` writes the model's outputs.

The model and data are the kit tests' own pair (trainkit/tests/project/tasks/char_lm.py), split into the two
files the README asks for.
"""

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import TEMPLATE
from .launch_runs import launch_environment
from .test_make_it_yours import deleted_by_step_5, project_command, rewrite_the_sweep

PAIR = TEMPLATE / "trainkit" / "tests" / "project" / "tasks" / "char_lm.py"
OWN_SAMPLE = """
    @classmethod
    def prepare(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
        return ("--data.root", "docs")  # the project's own Markdown pages: text at hand


"""


def add_the_language_model(project: Path, package: str) -> None:
    """README steps 1 and 2: a model file and a data file in the package, and a config naming each."""
    source = PAIR.read_text()
    header, data, model = re.split(r"\n(?=class (?:TextFiles|CharLanguageModel)\b)", source)
    (project / "src" / package / "data" / "text_files.py").write_text(f"{header}\n{data}")
    (project / "src" / package / "models" / "char_lm.py").write_text(f"{header}\n{model}")
    (project / "configs" / "data" / "text_files.yaml").write_text(
        f"class_path: {package}.data.text_files.TextFiles\ninit_args:\n  root: docs\n  context: 32\n"
    )
    (project / "configs" / "model" / "char_lm.yaml").write_text(
        f"# vocab_size comes from the data module.\nclass_path: {package}.models.char_lm.CharLanguageModel\n"
        "init_args:\n  hidden: 64\n"
    )


def test_make_it_yours_for_a_language_model_leaves_every_test_passing(cookies_session, tmp_path):
    result = cookies_session.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    package = project.name.replace("-", "_")
    add_the_language_model(project, package)

    experiment = project / "configs" / "experiment.yaml"  # step 4
    text = experiment.read_text()
    for example, own in [("model/image_classifier.yaml", "model/char_lm.yaml"),
                         ("data/mnist.yaml", "data/text_files.yaml"), ("runs/experiment", "runs/char_lm"),
                         ("monitor: val/acc", "monitor: val/loss"), ("mode: max", "mode: min")]:  # fmt: skip
        assert example in text, f"the README's step 4 names {example}, which configs/experiment.yaml does not have"
        text = text.replace(example, own)
    experiment.write_text(text)
    rewrite_the_sweep(project, {"model.lr": {"distribution": "log_uniform_values", "min": 0.001, "max": 0.01},
                                "model.dropout": {"min": 0.0, "max": 0.3}})  # fmt: skip

    for path in deleted_by_step_5(project):  # step 5
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    your_code = project / "tests" / "test_your_code.py"
    text = re.sub(r"\n    # The example's digits.*?\n\n\n", OWN_SAMPLE, your_code.read_text(), flags=re.DOTALL)
    your_code.write_text(text.replace("from .example.fake_mnist import write_fake_mnist\n", ""))

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
                           env=launch_environment(project), capture_output=True, text=True, timeout=900)  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-3000:]
    assert re.search(r"\b(\d+) passed", tests.stdout) and " failed" not in tests.stdout, tests.stdout[-3000:]

    quick = ["--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "8",
             "--trainer.limit_val_batches", "2", "--trainer.limit_predict_batches", "2",
             "--trainer.logger", "false"]  # fmt: skip
    project_command(project, "train.py", "fit", "--config", "configs/experiment.yaml", *quick)
    project_command(
        project, "train.py", "predict", "--config", "configs/experiment.yaml", *quick, "--ckpt_path", "last"
    )
    with (project / "runs" / "char_lm" / "predictions.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert rows and list(rows[0]) == ["index", "next_characters"]
    assert len(rows[0]["next_characters"].split()) == 32  # a predicted character for each of the window's 32
