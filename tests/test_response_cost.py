"""Integration: bench/response_cost.py against the real tritonserver, on a tiny workload.

The figures themselves are a benchmark's business; this checks that every case streams every
response in order and that the costs and ratios it reports come from what it measured."""

from __future__ import annotations

import json

from bench import response_cost


def test_response_cost_streams_every_response_and_reports_per_response_cpu(tmp_path):
    result = response_cost.main(["--concurrency", "4", "--responses", "100", "--streams", "8", "--rounds", "1",
                                 "--out", str(tmp_path)])
    (round_,) = result["rounds"]
    assert set(round_) == set(response_cost.CASES)
    for case, m in round_.items():
        assert m["problems"] == [], (case, m["problems"])
        assert m["responses"] == 8 * 100, case
        assert m["responses_per_s"] > 0 and m["server_ms_per_response"] > 0, case
    cases = result["cases"]
    assert result["ratios"]["ensemble_7_vs_direct_7"] == round(
        cases["ensemble_7"]["total_ms_per_response"] / cases["direct_7"]["total_ms_per_response"], 2)
    saved = json.loads((tmp_path / result["path"].rsplit("/", 1)[1]).read_text())
    assert saved["ratios"] == result["ratios"]
