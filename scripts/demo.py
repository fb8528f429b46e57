"""Generate a project with the default answers, train it on real MNIST digits and report held-out accuracy.

Runs offline on CPU with no wandb account: the project logs to wandb offline when there is no key.
The data is the shipped sample (sample_data/mnist-t10k): 8,000 digits to train and validate on,
2,000 held out for the final test.

    python scripts/demo.py [OUT_DIR]
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest.mock import patch

from cookiecutter.main import cookiecutter

from mnist_sample import write_split

TEMPLATE = Path(__file__).resolve().parent.parent
MIN_ACCURACY = 0.95


def generate(out_dir: Path) -> Path:
    """The default project in OUT_DIR, installed into this Python environment."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # cookiecutter leaves a copy of each hook it ran in the temporary folder: here, one removed afterwards.
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch, patch.object(tempfile, "tempdir", scratch):
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out_dir), overwrite_if_exists=True))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-e", str(project)], check=True)
    return project


def train_and_test(project: Path, data_dir: Path, run_dir: Path) -> float:
    """`fit` with the project's default config, then `test` the last checkpoint; the held-out accuracy."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    common = ["--config", "configs/experiment.yaml", "--data.data_dir", str(data_dir), "--data.download", "false",
              "--trainer.default_root_dir", str(run_dir)]  # fmt: skip
    train = [sys.executable, "train.py"]
    subprocess.run([*train, "fit", *common], cwd=project, check=True)
    tested = subprocess.run(
        [*train, "test", *common, "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")],
        cwd=project,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    print(tested.stdout)
    return float(re.search(r"test/acc\W+([0-9.]+)", tested.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=TEMPLATE / "build" / "demo")
    out_dir = parser.parse_args().out_dir.resolve()
    project = generate(out_dir)
    write_split(out_dir / "data", train=8000)
    accuracy = train_and_test(project, out_dir / "data", out_dir / "runs" / "demo")
    print(f"Held-out accuracy on 2,000 real MNIST digits not seen in training: {accuracy:.2%}")
    print(f"The generated project is {project}; its run (checkpoints, config, wandb) is in {out_dir / 'runs'}.")
    if accuracy < MIN_ACCURACY:
        sys.exit(f"error: accuracy {accuracy:.2%} is below {MIN_ACCURACY:.0%}")


if __name__ == "__main__":
    main()
