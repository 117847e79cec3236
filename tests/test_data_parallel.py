"""One frontend in front of two real tritonservers (data parallelism: one per GPU on a GPU host), as
scripts/docker-entrypoint.sh runs them with DATA_PARALLEL_SIZE=2, called with the OpenAI SDK: each
chat stays on the server that holds its prefix, aborts and prefix-cache resets reach both, a
killed server's requests go to the other while the supervisor starts it again, and then it takes
new chats again."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from client.local_server import triton_home
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import metric_value, scrape_metric, serve_in_thread, wait_kv_blocks_free
from tests.entrypoint import Entrypoint

MODEL = "demo"
SYSTEMS = {
    "ledger": "You are the accounting team's assistant. Answer about ledgers, journals and audits. " * 6,
    "travel": "You plan train journeys across Europe; give times, changes and prices in euros. " * 6,
    "garden": "You answer questions about vegetable gardens, soil and the seasons, in short lists. " * 6,
}


@dataclass
class _Server:
    grpc_url: str
    metrics_url: str


@pytest.fixture(scope="module")
def entry(demo_model_path, tmp_path_factory):
    if not (triton_home() / "backends" / "python" / "triton_python_backend_stub").exists():
        pytest.skip("tritonserver's Python backend stub is not installed (scripts/setup.sh)")
    e = Entrypoint(demo_model_path, tmp_path_factory.mktemp("data_parallel") / "entrypoint.log",
                   data_parallel_size=2, env={"LLM_NUM_KV_BLOCKS": "256"})
    try:
        yield e.start()
    finally:
        if e.process is not None:
            e.stop(30)


@pytest.fixture(scope="module")
def servers(entry):
    return [_Server(g, m) for g, m in zip(entry.grpc_urls(), entry.metrics_urls())]


def _frontend(servers, **settings):
    urls = ",".join(s.grpc_url for s in servers)
    return serve_in_thread(create_app(Settings(triton_url=urls, model_name=MODEL, abort_model="llm", **settings)))


@pytest.fixture(scope="module")
def base_url(entry):
    return entry.url  # the entrypoint's frontend, over both servers


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _ensemble_requests(server) -> float:
    return scrape_metric(server.metrics_url, "nv_inference_request_success", 'model="ensemble",version="1"') or 0.0


def _chat_turns(url: str, system: str, turns: int) -> list[int]:
    """A chat of `turns` user turns, each sent with the history so far: each turn's cached tokens."""
    sdk = _sdk(url)
    messages = [{"role": "system", "content": system}]
    cached = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what should I look at first?"})
        r = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
    return cached


def test_each_chat_stays_where_its_prefix_is_cached(servers, base_url):
    before = [_ensemble_requests(s) for s in servers]
    cached = {name: _chat_turns(base_url, system, 3) for name, system in SYSTEMS.items()}
    after = [_ensemble_requests(s) for s in servers]
    # Every later turn finds at least its system prompt cached: it went where the first turn went.
    for name, per_turn in cached.items():
        assert all(c >= 64 for c in per_turn[1:]), (name, per_turn)
    # And the chats were spread: both servers served some.
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 9 and min(served) >= 3, served
    # The frontend's /metrics count, per server, the prompt chunks it routed there and had before.
    metrics = httpx.get(f"{base_url}/metrics").text
    for s in servers:
        sent = metric_value(metrics, "frontend_triton_server_prompt_chunks_total", f'server="{s.grpc_url}"')
        matched = metric_value(metrics, "frontend_triton_server_prompt_chunks_matched_total", f'server="{s.grpc_url}"')
        assert sent > matched > 0, metrics
    # The same chats through round robin: every second turn lands where its history is not.
    with _frontend(servers, router_policy="round_robin") as url:
        rr = _chat_turns(url, "A new system prompt for round robin, never seen by either server. " * 6, 3)
    assert rr[1] < 16, rr


def test_health_info_aborts_and_cache_resets_cover_both_servers(servers, base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    r = httpx.get(f"{base_url}/health_generate", timeout=60)  # a token from each server
    assert r.status_code == 200 and r.json() == {"servers": {s.grpc_url: "ok" for s in servers}}, r.text
    info = httpx.get(f"{base_url}/get_server_info").json()["engine"]
    assert [d["url"] for d in info["data_parallel"]] == [s.grpc_url for s in servers]
    assert info["stats"]["num_kv_blocks"] == 512  # the two pools of 256, summed

    # Two long streams, one on each server (different prefixes: spread), aborted by one call.
    sdk, results = _sdk(base_url), {}
    started = {name: threading.Event() for name in ("ledger", "travel")}
    sent_before = _sent(base_url, servers)

    def stream(name: str) -> None:
        chunks = sdk.chat.completions.create(
            model=MODEL, stream=True, max_tokens=3900, temperature=1.0, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": SYSTEMS[name]}, {"role": "user", "content": "go on"}])
        reasons = results[name] = []
        for chunk in chunks:
            started[name].set()
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)

    threads = [threading.Thread(target=stream, args=(name,)) for name in started]
    for t in threads:
        t.start()
    assert all(event.wait(30) for event in started.values())
    # At once: a stream of the demo model runs to its length within seconds on a busy host.
    r = httpx.post(f"{base_url}/abort_request", json={"abort_all": True})
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(30)
    assert results == {"ledger": ["abort"], "travel": ["abort"]}
    # One on each server, as the frontend counts them.
    assert [a - b for a, b in zip(_sent(base_url, servers), sent_before)] == [1, 1]
    for server in servers:
        wait_kv_blocks_free(server.metrics_url)

    # /flush_cache empties both prefix caches: the next turn of a cached chat is cold.
    assert _chat_turns(base_url, SYSTEMS["garden"], 2)[1] >= 64
    assert httpx.post(f"{base_url}/flush_cache").status_code == 200
    assert _chat_turns(base_url, SYSTEMS["garden"], 1) == [0]


def test_frontend_processes_share_what_each_server_was_sent(servers, demo_model_path, tmp_path):
    """Two --workers processes, each turn on a new connection (either process may take it), and
    one system prompt for every chat: each later turn finds its own history cached, as the
    processes share one router memory. With a memory each, a turn that reaches the process that
    never saw its chat goes where that process saw the system prompt (which process accepts a
    connection is the kernel's choice: without the shared memory this failed 1 run in 2)."""
    from bench.serving_bench import Frontend

    system = "You are the help desk of a city library: loans, renewals, opening hours and events. " * 8
    frontend = Frontend(",".join(s.grpc_url for s in servers), demo_model_path, tmp_path / "frontend.log",
                        name=MODEL, workers=2).start()
    try:
        url = f"http://127.0.0.1:{frontend.port}"
        for chat in range(6):
            messages = [{"role": "system", "content": system}]
            prompts, cached = [], []
            for turn in range(3):
                messages.append({"role": "user", "content": f"Reader {chat}, question {turn}: can I renew?"})
                with httpx.Client(timeout=60) as http:  # a connection of its own
                    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
                    r = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
                prompts.append(r.usage.prompt_tokens)
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                messages.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
            # Each later turn: the previous turn's prompt cached (whole 16-token blocks of it).
            assert all(c >= p - 32 for c, p in zip(cached[1:], prompts)), (chat, prompts, cached)
        # A Responses conversation, each turn on a new connection, continued by id: the stored
        # turns are in a directory both processes read (with a store each, a turn that reached
        # the other process would be a 400; which process takes a connection is the kernel's
        # choice, so tests/test_responses_api.py checks the sharing itself).
        previous = None
        for turn in range(5):
            with httpx.Client(timeout=60) as http:
                sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
                r = sdk.responses.create(model=MODEL, instructions=system, input=f"Question {turn}: can I renew?",
                                         previous_response_id=previous, max_output_tokens=4, temperature=0)
            assert turn == 0 or r.usage.input_tokens_details.cached_tokens >= 64, r.usage
            previous = r.id
    finally:
        frontend.stop()


def _sent(base_url: str, servers) -> list[float]:
    """Generations the frontend has sent each server."""
    metrics = httpx.get(f"{base_url}/metrics").text
    return [metric_value(metrics, "frontend_triton_server_requests_total", f'server="{s.grpc_url}"') or 0.0
            for s in servers]


def _up(base_url: str, servers) -> dict[str, float]:
    metrics = httpx.get(f"{base_url}/metrics").text
    return {s.grpc_url: metric_value(metrics, "frontend_triton_server_up", f'server="{s.grpc_url}"') for s in servers}


def test_a_killed_server_s_chats_go_to_the_other_and_it_serves_again_once_restarted(entry, servers, base_url):
    """Last in this module: it kills one of the servers."""
    homes = {}
    for name, system in SYSTEMS.items():
        before = [_ensemble_requests(s) for s in servers]
        _chat_turns(base_url, system, 1)
        homes[name] = max(range(2), key=lambda i: _ensemble_requests(servers[i]) - before[i])
    killed = homes["ledger"]
    os.kill(entry.tritonserver_pids()[killed], signal.SIGKILL)
    # Its chats now go to the other server, from the first request on: none fails.
    for name in SYSTEMS:
        assert len(_chat_turns(base_url, SYSTEMS[name], 2)) == 2
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert _up(base_url, servers) == {servers[killed].grpc_url: 0, servers[1 - killed].grpc_url: 1}
    # /health_generate still answers 200 (the other server generates), and says which is not.
    r = httpx.get(f"{base_url}/health_generate", timeout=60)
    assert r.status_code == 200 and r.json()["servers"][servers[1 - killed].grpc_url] == "ok", r.text
    assert r.json()["servers"][servers[killed].grpc_url] != "ok", r.text
    streamed = _sdk(base_url).chat.completions.create(
        model=MODEL, stream=True, max_tokens=8, messages=[{"role": "system", "content": SYSTEMS["ledger"]},
                                                          {"role": "user", "content": "one more"}])
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["length"]

    # The supervisor starts it again, the other serving meanwhile; the frontend finds it by itself.
    name = entry.names()[killed]
    deadline = time.monotonic() + 240
    while entry.log().count(f"{name} ready") < 2 or _up(base_url, servers)[servers[killed].grpc_url] != 1:
        assert entry.process.poll() is None and time.monotonic() < deadline, entry.supervisor_lines()
        httpx.get(f"{base_url}/health")  # asks each server
        time.sleep(0.5)
    # The watchdog may see the server gone, or (on busy cores) first its stub gone and then the
    # SIGKILL: both are logged as exited with 137.
    assert re.search(rf"{name} exited \(status 137[,)]", entry.log())
    # New chats go to it again (what the frontend remembered of the killed one was dropped), and the
    # moved ones stay where their history now is.
    served = _ensemble_requests(servers[killed])
    for i in range(4):
        _chat_turns(base_url, f"Chat {i} after the restart: a system prompt of its own, long enough to count. " * 3, 1)
    assert _ensemble_requests(servers[killed]) > served
    before = _ensemble_requests(servers[killed])
    assert all(c >= 64 for c in _chat_turns(base_url, SYSTEMS["ledger"], 2))
    assert _ensemble_requests(servers[killed]) == before
