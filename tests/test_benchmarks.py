"""Every benchmark script runs end to end at toy sizes, so that none of them can rot unnoticed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_gpu_check_runs_on_the_cpu():
    out = run("gpu_check.py", "--device", "cpu")
    lines = dict(line.split(": ", 1) for line in out.splitlines()[1:] if ": " in line)
    assert set(lines) >= {"fit", "syncs", "split_bn", "bf16_logits", "knn_memory", "checkpoint"}
    assert not any(v.startswith("FAILED") for v in lines.values()), lines
    assert "queue torch.float32" in lines["fit"] and "ours 0.00e+00" in lines["bf16_logits"]
