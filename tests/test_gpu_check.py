"""`bash scripts/gpu_check.sh --dry-run`: the GPU check's every check runs on the CPU, as the suite can.

Each line and the JSON agree; nothing fails; SKIP only where a GPU is needed (compiling). The
2-process checks and the lost-node drill run over gloo. Timings are never judged: the throughput
line may be PASS or WARN.
"""

import json
import math
import sys

from .conftest import TEMPLATE

sys.path.insert(0, str(TEMPLATE / "bench"))

import gpu_check

EXPECTED = {
    "install": "PASS",
    "fit_default": "PASS",
    "fit_compiled": "SKIP",
    "fit_data_on_device": "PASS",
    "background_save": "PASS",
    "preempt_resume": "PASS",
    "rng_resume": "PASS",
    "ddp_fit": "PASS",
    "ddp_preempt_resume": "PASS",
    "ddp_rng_resume": "PASS",
    "lost_node": "PASS",
}


def test_the_gpu_check_dry_runs_on_the_cpu(default_project, real_mnist, tmp_path, capsys):
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--project", str(default_project),
                             "--data-dir", str(real_mnist)])  # fmt: skip
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = {check["name"]: check for check in results["checks"]}

    assert status == 0, printed
    assert {name: check["status"] for name, check in checks.items() if name != "throughput"} == EXPECTED, printed
    assert checks["throughput"]["status"] in ("PASS", "WARN"), printed
    assert [line.split(":")[0] for line in printed.splitlines() if line[:4] in ("PASS", "WARN", "FAIL", "SKIP")] == [
        f"{check['status']:<4} {check['name']}" for check in results["checks"]
    ], printed  # one line per check, in the JSON's order
    assert str(tmp_path / "gpu_check.json") in printed.splitlines()[-1]
    assert "Would install" in (tmp_path / "logs" / "install.log").read_text()  # pip's own words, kept
    assert results["machine"]["accelerator"] == "cpu"
    for name in ("template_vs_reference", "template_images_per_s", "reference_images_per_s"):
        assert math.isfinite(checks["throughput"]["figures"][name])
    # The CPU's meaning of each setting, for every process of the 2-process fit.
    assert checks["ddp_fit"]["figures"]["devices"] == ["cpu", "cpu"]
    assert checks["ddp_fit"]["figures"]["backend"] == "gloo"
    assert checks["preempt_resume"]["figures"]["saved"]["mid_epoch"]
    assert checks["ddp_preempt_resume"]["figures"]["differing"] == 0
    resumed = checks["ddp_rng_resume"]["figures"]["resumed"]
    assert resumed[0] != resumed[1]  # each process its own generators
    assert checks["lost_node"]["figures"]["statuses"] == [75, 75]
