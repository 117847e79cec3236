"""bench/decode_probe.py runs end to end on the CPU (on a GPU host it also times the decode graphs)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_decode_probe_times_and_profiles_eager_steps(demo_model_path, tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "-m", "bench.decode_probe", "--device", "cpu", "--model-path", str(demo_model_path),
                    "--batches", "1", "3", "--context", "40", "--steps", "3", "--warmup", "1", "--profile-steps", "1",
                    "--kv-cache-memory-mb", "64", "--json", str(out)], cwd=REPO, check=True, capture_output=True,
                   timeout=240)
    run = json.loads(out.read_text())["runs"]["eager_splits_1"]
    assert run["cuda_graphs"] is False
    for batch in ("1", "3"):
        row = run[batch]
        assert 0 < row["forward_ms_p50"] <= row["step_ms_p50"]
        assert row["profile"]["steps"] == 1 and row["profile"]["own_time_ms_per_step"] > 0
        assert "aten::" in row["profile"]["table"]
