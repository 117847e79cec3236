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
