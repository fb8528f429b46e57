"""Optional features without their extra: one line naming the install, exit 2, before anything trains."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import PROJECT_ROOT, clean_env, quick_run_args, run_chunks, run_train


def without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment in which importing `package` fails as it does when it is not installed."""
    site = tmp_path / f"without-{package}"
    site.mkdir()
    failing_import = f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n"
    (site / f"{package}.py").write_text(failing_import)
    return clean_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def assert_one_line_naming_the_extra(result: subprocess.CompletedProcess, package: str, extra: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{package}" in errors[0] and f"pip install -e '.[{extra}]'" in errors[0], errors[0]


def test_checkpoints_in_s3_without_boto3(experiment, tmp_path):
    args = [*quick_run_args(experiment, tmp_path / "run"), "--checkpoint_store.url", "s3://bucket/job"]
    result = run_train("fit", *args, env=without(tmp_path, "boto3"))
    assert_one_line_naming_the_extra(result, "boto3", "s3")
    assert not list((tmp_path / "run").rglob("*.ckpt")), "it trained"


def test_the_local_sweep_without_optuna(tmp_path):
    command = [sys.executable, "-m", "trainkit.sweep", "configs/sweep.yaml", "--count", "1", "--root", str(tmp_path)]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=without(tmp_path, "optuna"), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert_one_line_naming_the_extra(result, "optuna", "sweep")


def test_chunks_without_litdata(experiment, tmp_path):
    result = run_chunks("--config", str(experiment), "--out", str(tmp_path / "c"), env=without(tmp_path, "litdata"))
    assert_one_line_naming_the_extra(result, "litdata", "streaming")


@pytest.mark.skipif(
    not (PROJECT_ROOT / "configs" / "data" / "streaming_images.yaml").exists(), reason="the example's streaming config"
)
def test_a_data_module_that_imports_litdata_without_it(experiment, tmp_path):
    streaming = PROJECT_ROOT / "configs" / "data" / "streaming_images.yaml"
    args = [*quick_run_args(experiment, tmp_path / "run"), "--data", str(streaming), "--data.input_dir", str(tmp_path)]
    result = run_train("fit", *args, env=without(tmp_path, "litdata"))
    assert_one_line_naming_the_extra(result, "litdata", "streaming")
