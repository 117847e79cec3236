"""bench/serving_bench.py's own arithmetic (the benchmark itself runs as a script)."""

from bench.serving_bench import compare_outputs


def test_equal_outputs():
    assert compare_outputs([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == {
        "outputs_equal": True, "requests_equal": "2/2", "first_divergence": []}


def test_where_outputs_part():
    got = compare_outputs([[1, 2, 3], [4, 5], [7, 8]], [[1, 9, 3], [4, 5], [7]])
    # the second request agrees; the first parts at its token 1; the third is cut short at 1
    assert got == {"outputs_equal": False, "requests_equal": "1/3", "first_divergence": [1, 1]}


def test_a_missing_request_is_not_equal():
    assert compare_outputs([[1], [2]], [[1]])["outputs_equal"] is False


def test_nothing_compared_is_not_equal():
    # QA: both sides returning nothing (every request failed) read as equal outputs.
    assert compare_outputs([], [])["outputs_equal"] is False


def test_a_path_that_measured_nothing_misses_its_target():
    from bench.serving_bench import div

    assert div(0.0, 120.0) == 0.0  # every request failed: 0, a missed target (was n/a)
    assert div(60.0, 120.0) == 0.5
    assert div(60.0, 0.0) is None and div(None, 1.0) is None and div(1.0, None) is None  # no baseline


def test_bad_options_are_refused_not_replaced(capsys):
    import pytest

    from bench.serving_bench import parse_args

    for argv, said in ((["--num-requests", "0"], "--num-requests must be at least 1"),
                       (["--concurrency", "0", "4"], "--concurrency levels must be at least 1"),
                       (["--max-new", "0"], "--max-new must be at least 1"),
                       (["--chunked-repeats", "0"], "--chunked-repeats must be at least 1"),
                       (["--min-new", "50", "--max-new", "10"], "--min-new <= --max-new"),
                       (["--min-new", "300"], "--min-new <= --max-new"),  # past the default 256
                       (["--c1-requests", "-1"], "--c1-requests must be 0 or more"),
                       (["--temperature", "-0.5"], "--temperature must be 0 or more"),
                       (["--only", ""], "--only needs at least one section"),
                       (["--only", "engine", "--skip", "engine"], "leave no section to run")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err, argv
    args = parse_args(["--quick", "--only", "engine,triton", "--num-requests", "4"])
    assert args.sections == {"engine", "triton"} and args.num_requests == 4 and args.concurrency == [1, 4, 16]


def test_an_interrupt_while_the_frontend_starts_stops_it(tmp_path, demo_model_path, monkeypatch):
    # QA: Ctrl-C during the health wait left `python -m openai_frontend` running.
    import urllib.request

    import pytest

    from bench.serving_bench import Frontend

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(urllib.request, "urlopen", interrupted)
    fe = Frontend("localhost:1", demo_model_path, tmp_path / "frontend.log")
    with pytest.raises(KeyboardInterrupt):
        fe.start(timeout=30)
    assert fe.proc is None  # terminated and waited for


def test_a_salted_workload_sends_each_request_its_own_cache_salt():
    # prefix_servers' "off": a salt per request keeps every request from the cached prefix, on
    # both paths (the ensemble's sampling_parameters, the frontend's extra body).
    from bench.load_clients import Workload

    plain = Workload([[1, 2], [3, 4]], [4, 4], 0.0, [0, 0])
    salted = Workload([[1, 2], [3, 4]], [4, 4], 0.0, [0, 0], cache_salts=["a", "b"])
    assert "cache_salt" not in plain.sampling(0)
    assert [salted.sampling(i)["cache_salt"] for i in range(2)] == ["a", "b"]


def test_the_sdk_part_of_a_request_runs_the_real_sdk_against_a_stand_in():
    # No server: a transport that answers at once (a wrong stand-in answer fails the SDK's parse).
    from bench.serving_bench import sdk_request_ms

    assert 0 < sdk_request_ms(list(range(100, 1124)), 4, repeats=2) < 5000
