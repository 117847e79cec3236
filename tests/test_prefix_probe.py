"""bench/prefix_probe.py runs end to end on the CPU: a cached prefix leaves each request's suffix,
and every request gets its first token from one step (on a GPU host it times the flat step)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_prefix_probe_times_first_tokens_off_and_on(demo_model_path, tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "-m", "bench.prefix_probe", "--device", "cpu", "--model-path", str(demo_model_path),
                    "--prefix-len", "128", "--requests", "3", "--kv-cache-memory-mb", "64", "--json", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=240)
    got = json.loads(out.read_text())
    for mode in ("off", "on"):
        row = got[mode]
        assert row["steps_to_first_token"] == [1, 1, 1]
        assert 0 < row["forward_ms_p50"] <= row["step_ms_p50"] and len(row["loop_ttft_ms"]) == 3
        assert row["cached_tokens"] == ([128] * 3 if mode == "on" else [0] * 3)
    assert got["hand_ttft_ms_p50_off_over_on"] > 0
