"""Soak, CI size: concurrent streams through the frontend with random disconnects, max_tokens and
stop strings (seeded), then no leaked KV blocks, every completed answer equal to its own
reference, and a server that still answers. `scripts/soak.py` is the full version (500
concurrent by default) and the library used here.

Also a randomized storm straight on the engine, to check the block pool itself (not only the
metric that reports it): cancels, aborts, n > 1, shared prefixes, preemption in a small pool.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import threading
import time

import pytest

from tests.conftest import REPO_ROOT


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak_script", REPO_ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.fixture(scope="module")
def stack(demo_model_path, tmp_path_factory):
    # A small pool (48 blocks of 16 tokens) so 60 streams preempt each other.
    logs = tmp_path_factory.mktemp("soak")
    s = soak.Stack(demo_model_path, kv_blocks=48, max_model_len=256, log_dir=logs)
    try:
        s.start()
    except Exception:
        for f in logs.iterdir():
            print(f, f.read_text()[-3000:])
        raise
    yield s
    s.stop()


@pytest.mark.timeout(300)
def test_soak_through_the_frontend(stack):
    report = asyncio.run(soak.run_soak(
        stack.frontend.url, stack.metrics_url, requests=60, concurrency=60, seed=1234, max_tokens=48,
        disconnect_rate=0.25, stop_rate=0.4, timeout=120, reference_concurrency=1, drain_timeout=30,
    ))
    print(report.summary())
    assert not report.errors, report.errors
    assert not report.mismatches, report.mismatches[:3]
    assert report.completed + report.disconnected == 60
    assert report.matched == report.completed
    assert report.disconnected > 0 and report.disconnected_prefix_ok == report.disconnected
    assert report.finish_reasons.get("stop", 0) > 0 and report.finish_reasons.get("length", 0) > 0
    assert report.kv_drained and report.kv_blocks_used_after == 0
    assert report.still_answers
    # The engine saw the disconnects: most as aborts (a few streams end before the abort lands).
    assert report.engine_finished["abort"] >= report.disconnected // 2
    assert report.engine_finished["error"] == 0
    assert report.ok


@pytest.mark.timeout(180)
def test_engine_pool_after_random_cancel_storm(demo_model_path):
    from backend.config import EngineConfig
    from backend.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", num_kv_blocks=40, max_model_len=256,
                                    max_num_seqs=32))
    engine.start()
    rng = random.Random(5)
    shared = [rng.randrange(10, 4000) for _ in range(40)]  # a common prefix: cached, shared blocks
    done = threading.Event()
    lock = threading.Lock()
    state: dict[str, dict] = {}
    cancelled: set[int] = set()

    def on_output(i):
        def cb(out):
            with lock:
                st = state.setdefault(i, {"outputs": 0, "finished": 0, "error": None})
                st["outputs"] += 1
                if out.error:
                    st["error"] = out.error
                if out.finished:
                    st["finished"] += 1
                if st["outputs"] >= st.get("cancel_after", 10**9):
                    cancelled.add(i)
                if all(s["finished"] >= s["n"] for s in state.values() if "n" in s) and len(state) == total:
                    done.set()
        return cb

    try:
        total = 80
        ids = {}
        for i in range(total):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(10, 4000) for _ in range(rng.randint(1, 30))]
            n = rng.choice([1, 1, 1, 2])
            params = engine.parse_params({"max_new_tokens": rng.randint(1, 60), "ignore_eos": True, "n": n,
                                          "temperature": rng.choice([0.0, 0.9]), "seed": i})
            with lock:
                state[i] = {"outputs": 0, "finished": 0, "error": None, "n": n,
                            "cancel_after": rng.randint(1, 8) if rng.random() < 0.3 else 10**9}
            ids[i] = engine.add_request(prompt, params, on_output(i), is_cancelled=lambda i=i: i in cancelled)
            if rng.random() < 0.1:
                engine.abort(ids[i])
            if rng.random() < 0.2:
                time.sleep(0.01)
        assert done.wait(120), "requests did not all finish"
        deadline = time.monotonic() + 10
        while engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
            assert time.monotonic() < deadline, (
                f"{engine.block_manager.num_blocks - engine.block_manager.num_free_blocks} KV blocks leaked"
            )
            time.sleep(0.05)
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert not engine.has_unfinished()
        assert all(s["error"] is None for s in state.values())
        assert all(s["finished"] == s["n"] for s in state.values())
        # Still serving after the storm.
        probe = [rng.randrange(10, 4000) for _ in range(12)]
        params = engine.parse_params({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        outs = []
        finished = threading.Event()

        def collect(out):
            outs.append(out)
            if out.finished:
                finished.set()

        engine.add_request(probe, params, collect)
        assert finished.wait(30)
        assert sum(len(o.new_token_ids) for o in outs) == 8
    finally:
        engine.shutdown()
