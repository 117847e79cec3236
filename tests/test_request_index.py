"""backend/request_index.py: Triton request ids -> engine requests, and aborts that come first."""

from backend.request_index import TritonRequestIndex


def test_request_index_aborts_known_and_early_requests():
    now = [0.0]
    index = TritonRequestIndex(remember_s=10, max_remembered=2, clock=lambda: now[0])
    assert index.add("t1", "e1") is False and index.add("t1", "e2") is False
    index.forget("t1", "e2")
    assert index.abort("t1") == {"e1"} and len(index) == 0
    # An abort that finds nothing is remembered: the request it names is aborted on arrival.
    assert index.abort("t2") == set()
    assert index.add("t2", "e3") is True and len(index) == 0
    assert index.add("t2", "e4") is False  # once only
    # ... for a while, and only the newest few.
    index.abort("old")
    now[0] = 11
    assert index.add("old", "e5") is False
    for name in ("a", "b", "c"):
        index.abort(name)
    assert index.add("a", "e6") is False and index.add("c", "e7") is True


def test_an_abort_for_a_finished_request_is_a_no_op():
    # QA: a late abort (the request had already finished) was remembered and aborted the next
    # request a client sent under the same id. SGLang ignores an abort for a finished rid.
    now = [0.0]
    index = TritonRequestIndex(remember_s=10, clock=lambda: now[0])
    assert index.add("R1", "e1") is False
    index.forget("R1", "e1")
    assert index.abort("R1") == set()
    assert index.add("R1", "e2") is False  # the retry under the same id runs
    index.forget("R1", "e2")
    now[0] = 11  # long after: an abort that finds nothing is taken as one that came first again
    assert index.abort("R1") == set() and index.add("R1", "e3") is True
