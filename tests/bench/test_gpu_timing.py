"""The GPU timing script runs end to end on a small random model on CPU (``--shape tiny``), so
that the few minutes a GPU is lent are not lost to a script that no longer runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_timing_script_runs_on_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_timing.py"), "--shape", "tiny", "--device", "cpu", "--dtype",
           "float32", "--context", "32", "--new-tokens", "8", "--batches", "1,2", "--reps", "1", "--out", str(out)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert sorted(int(n) for n in report["forward_seconds"]) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert set(report["drafters"]) == {"dspark", "dflash", "eagle3"}
    assert [row["batch"] for row in report["engine"]] == [1, 2] and all(row["lossless"] for row in report["engine"])
