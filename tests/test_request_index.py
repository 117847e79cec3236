"""backend/request_index.py: Triton request ids -> engine requests, and aborts that come first."""

import pytest

from backend.request_index import TritonRequestIndex, client_of, names_client, sample_of


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


def test_a_repeated_abort_of_an_aborted_request_is_a_no_op():
    # Review: the abort that took a running request left no trace of it, so a second abort (a
    # client's retry) was remembered as one that came first and aborted the next request sent
    # under that id on arrival.
    index = TritonRequestIndex()
    assert index.add("job-1", "e1") is False
    assert index.abort("job-1") == {"e1"}
    assert index.abort("job-1") == set()
    assert index.add("job-1", "e2") is False
    index.add("R@fe.1", "e3")
    assert index.abort_client("fe", "R") == (1, {"e3"})
    assert index.abort("R@fe.1") == set() and index.add("R@fe.1", "e4") is False


def test_client_ids_parse_from_the_right():
    assert client_of("rid-1@fe01.ab12cd34") == ("rid-1", "fe01")
    assert client_of("a.b@c@fe01.ab12") == ("a.b@c", "fe01")  # a client id may hold '@' and '.'
    for triton_id in ("plain", "no-frontend.ab12", "x@.ab12", "ab12"):
        assert client_of(triton_id) is None, triton_id


def test_an_abort_names_a_request_and_its_batch_items():
    assert names_client("R", "R") and names_client("R", "R_0") and names_client("R", "R-12")
    # QA: a request its client named R_1 is not R's batch item; an abort for R left it alone.
    assert names_client("R", "R", batch_item=False) and not names_client("R", "R_1", batch_item=False)
    for client_id in ("R_x", "R_", "RR_0", "R0", "S", "R_0_1"):
        assert not names_client("R", client_id), client_id


def test_abort_client_takes_a_frontends_running_requests_by_rid_or_all():
    index = TritonRequestIndex()
    running = {"R@fe.1": "e1", "R_0@fe.b-2": "e2", "R-1@fe.rid-b-3": "e3", "S@fe.4": "e4",
               "R@other.5": "e5", "R.plain": "e6", "R_1@fe.rid-8": "e8"}
    for triton_id, engine_id in running.items():
        index.add(triton_id, engine_id)
    index.add("R@fe.1", "e1b")  # n > 1: one Triton request, two engine requests
    assert index.abort_client("fe", "R") == (3, {"e1", "e1b", "e2", "e3"})
    assert index.abort_client("fe", "R") == (0, set())  # taken once; nothing is remembered
    index.add("R@fe.7", "e7")
    assert index.abort_client("fe", None) == (3, {"e4", "e7", "e8"})  # every request of that frontend
    assert len(index) == 2  # the other frontend's and the plain id's stay
    assert index.abort("R@other.5") == {"e5"} and index.abort("R.plain") == {"e6"}


def test_a_client_named_id_runs_once_per_frontend():
    from backend.request_index import NAMED_SUFFIX, DuplicateRequestId
    from openai_frontend.triton_client import NAMED_SUFFIX as FRONTEND_MARK

    assert FRONTEND_MARK == NAMED_SUFFIX
    idx = TritonRequestIndex()
    first = f"job-1@fe1.{NAMED_SUFFIX}aaaa"
    assert idx.add(first, "e1") is False
    # The same name from another worker of the frontend (another suffix) is refused ...
    with pytest.raises(DuplicateRequestId, match="Duplicate request ID detected: job-1"):
        idx.add(f"job-1@fe1.{NAMED_SUFFIX}bbbb", "e2")
    # ... not from another frontend, nor an unnamed id, nor the batch items of that name.
    assert idx.add(f"job-1@fe2.{NAMED_SUFFIX}cccc", "e3") is False
    assert idx.add("job-1@fe1.dddd", "e4") is False
    assert idx.add(f"job-1_0@fe1.{NAMED_SUFFIX}eeee", "e5") is False
    # Free again once it finished, or was aborted by id or by client.
    idx.forget(first, "e1")
    second = f"job-1@fe1.{NAMED_SUFFIX}ffff"
    assert idx.add(second, "e6") is False
    assert idx.abort(second) == {"e6"}
    third = f"job-1@fe1.{NAMED_SUFFIX}gggg"
    assert idx.add(third, "e7") is False
    assert idx.abort_client("fe1", "job-1")[0] >= 1
    assert idx.add(f"job-1@fe1.{NAMED_SUFFIX}hhhh", "e8") is False


def test_abort_client_ends_one_sample_by_its_id():
    # QA: sample i of an n > 1 request reports the id <rid>_<i>; an abort by it matched nothing.
    assert sample_of("R_1", "R") == 1 and sample_of("R_0_2", "R_0") == 2
    for rid, client_id in (("R_1", "S"), ("R_", "R"), ("R_x", "R"), ("R", "R"), ("R-1", "R")):
        assert sample_of(rid, client_id) is None, (rid, client_id)
    index = TritonRequestIndex()
    index.add("R@fe.1", "e1", n=3)
    index.add("S@fe.2", "e2")  # n = 1: its only sample is S itself
    index.add("B_0@fe.b-3", "e3", n=2)  # prompt 0 of batch B
    assert index.abort_client("fe", "R_2") == (1, {"e1#2"})
    assert index.abort_client("fe", "R_2") == (0, set())  # counted once
    assert index.abort_client("fe", "R_3") == (0, set()) and index.abort_client("fe", "S_0") == (0, set())
    assert index.abort_client("other", "R_1") == (0, set())
    assert index.abort_client("fe", "B_0_1") == (1, {"e3#1"})
    assert len(index) == 3  # the requests run on for their other samples
    assert index.abort_client("fe", "R") == (1, {"e1"})
    index.forget("B_0@fe.b-3", "e3")
    index.add("B_0@fe.b-4", "e3", n=2)  # an engine id is never reused; were it, nothing would linger
    assert index.abort_client("fe", "B_0_1") == (1, {"e3#1"})


def test_the_samples_names_of_a_named_request_are_taken_across_workers():
    # QA (--frontend-workers 3): only the worker running `x` with n = 2 refused `x_0`; another
    # accepted it, two requests then reported the id x_0, and one abort by it ended both.
    from backend.request_index import NAMED_SUFFIX, DuplicateRequestId

    idx = TritonRequestIndex()
    x = f"x@fe.{NAMED_SUFFIX}a1"
    assert idx.add(x, "e1", n=2) is False
    for name in ("x_0", "x_1"):
        with pytest.raises(DuplicateRequestId, match=f"Duplicate request ID detected: {name}$"):
            idx.add(f"{name}@fe.{NAMED_SUFFIX}b2", "e2")
    assert idx.add(f"x_2@fe.{NAMED_SUFFIX}c3", "e3") is False  # not one of its samples
    # The other way round: a running `y_1` takes that name from a later `y` with n = 2.
    assert idx.add(f"y_1@fe.{NAMED_SUFFIX}d4", "e4") is False
    with pytest.raises(DuplicateRequestId, match="Duplicate request ID detected: y_1$"):
        idx.add(f"y@fe.{NAMED_SUFFIX}e5", "e5", n=2)
    assert idx.add(f"y@fe.{NAMED_SUFFIX}e5", "e5") is False  # n = 1: y_1 is not its name
    # Free again once the request ended, or was aborted.
    idx.forget(x, "e1")
    assert idx.add(f"x_0@fe.{NAMED_SUFFIX}f6", "e6") is False
    z = f"z@fe.{NAMED_SUFFIX}g7"
    assert idx.add(z, "e7", n=3) is False
    assert idx.abort(z) == {"e7"}
    assert idx.add(f"z_2@fe.{NAMED_SUFFIX}h8", "e8") is False


def test_a_name_its_client_chose_runs_once_at_a_time_and_is_not_aborted_ahead():
    """QA (Triton HTTP `rid`): an abort of a refused request, or a mistyped one, ended the next
    request of that name for a minute; and two running requests under one name were both ended
    by one abort. SGLang's rid: refused while running, an abort of nothing does nothing."""
    from backend.request_index import DuplicateRequestId

    index = TritonRequestIndex()
    assert index.abort("job") == set()  # nothing runs under it (the request was refused)
    assert index.add("job", "e1", chosen=True) is False  # the retry runs
    with pytest.raises(DuplicateRequestId, match="Duplicate request ID detected: job"):
        index.add("job", "e2", chosen=True)
    assert index.abort("job") == {"e1"}
    assert index.add("job", "e3", chosen=True) is False  # free again once it ended
    index.forget("job", "e3")
    # a Triton id its client did not choose by parameter keeps the early-abort rule
    assert index.abort("t9") == set() and index.add("t9", "e4") is True
