"""Routing across several tritonservers (openai_frontend/router.py, TritonLLMClient with several
URLs): the policy alone, then the client over fake servers. tests/test_data_parallel.py runs two
real tritonservers behind one frontend."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from openai_frontend.engine_types import EngineRequest
from openai_frontend.errors import APIError
from openai_frontend.router import Router, RouterConfig, routing_key
from openai_frontend.router_memory import CHUNK_BYTES, WAYS, RouterMemory, chunk_hashes
from openai_frontend.testing import infer_response

SYSTEM_A = "You are a careful assistant for the accounting team. " * 8
SYSTEM_B = "Tu es un assistant qui répond en français, brièvement. " * 8


def _chat(system: str, *turns: str, **kwargs) -> EngineRequest:
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return EngineRequest({"max_new_tokens": 4, **kwargs}, messages=messages)


def _route(router: Router, request: EngineRequest, loads=(0, 0), eligible=(0, 1)) -> int:
    return router.choose(routing_key(request), list(loads), list(eligible))


# --- the policy -------------------------------------------------------------------------------


def test_a_chats_later_turns_go_where_its_first_turn_went():
    router = Router(2)
    first_a = _route(router, _chat(SYSTEM_A, "What is a ledger?"))
    first_b = _route(router, _chat(SYSTEM_B, "Quelle heure est-il ?"))
    assert first_a != first_b  # a new prefix goes to the server that has seen the least
    for turns in (("What is a ledger?", "A book of accounts.", "And a journal?"),
                  ("What is a ledger?", "A book of accounts.", "And a journal?", "Where entries start.", "Thanks")):
        assert _route(router, _chat(SYSTEM_A, *turns)) == first_a
        assert _route(router, _chat(SYSTEM_B, *turns)) == first_b
    # Round robin sends the same chat wherever the turn falls.
    rr = Router(2, RouterConfig(policy="round_robin"))
    assert [_route(rr, _chat(SYSTEM_A, "q")) for _ in range(4)] == [0, 1, 0, 1]


def test_cache_aware_gives_way_to_load_and_to_a_short_match():
    router = Router(2, RouterConfig(balance_abs_threshold=4))
    home = _route(router, _chat(SYSTEM_A, "q1"))
    other = 1 - home
    # Loads apart by up to the threshold: the cache wins.
    loads = [0, 0]
    loads[home] = 4
    assert _route(router, _chat(SYSTEM_A, "q1"), loads=loads) == home
    # Further apart: the least loaded takes it, cache or not (and has seen the prefix since: with
    # both having it, the less loaded one takes the next).
    loads[home] = 5
    assert _route(router, _chat(SYSTEM_A, "q1"), loads=loads) == other
    loads[home] = 1
    assert _route(router, _chat(SYSTEM_A, "q1"), loads=loads) == other
    # A prompt that shares less than cache_threshold of itself with what a server has seen is a new
    # prefix: it goes to the server that has seen the least.
    strict = Router(2, RouterConfig(cache_threshold=0.9))
    home = _route(strict, _chat(SYSTEM_A, "q"))
    long_question = "Explain double-entry bookkeeping with three worked examples. " * 30
    assert _route(strict, _chat(SYSTEM_A, long_question)) == 1 - home
    # Only eligible servers are chosen (one seen failing is skipped).
    assert _route(router, _chat(SYSTEM_A, "q1"), eligible=[other]) == other


def _route_turn(router: Router, request: EngineRequest, loads=(0, 0), eligible=(0, 1)) -> int:
    """As TritonLLMClient routes: with the chat's opening."""
    from openai_frontend.router import conversation_opening

    key = routing_key(request)
    return router.choose(key, list(loads), list(eligible), opening=conversation_opening(request, key))


def test_hash_placement_keeps_a_chat_on_one_server_across_frontend_processes():
    # Two --workers processes, each with its own memory; a chat's turns reach either of them.
    turns = [_chat(SYSTEM_A, "q1"), _chat(SYSTEM_A, "q1", "a1", "q2"), _chat(SYSTEM_A, "q1", "a1", "q2", "a2", "q3")]
    others = [_chat(f"Assistant {i}: " + SYSTEM_B, "hello") for i in range(6)]

    def homes(placement: str) -> list[int]:
        one, two = (Router(2, RouterConfig(placement=placement), names=["a:8001", "b:8001"]) for _ in range(2))
        for other in others:  # what the second process saw before: other chats, while b was busy
            assert _route_turn(two, other, loads=(0, 40)) == 0
        return [_route_turn(worker, turn) for worker, turn in zip((one, two, one), turns)]

    assert len(set(homes("hash"))) == 1
    # SGLang's least_seen placement is one process's view: the second process, which never saw
    # this chat, sends its second turn where it has placed the least.
    assert len(set(homes("least_seen"))) == 2


def test_hash_placement_spreads_new_chats_and_bounds_the_load():
    names = ["a:8001", "b:8001", "c:8001"]
    router = Router(3, RouterConfig(placement="hash"), names=names)
    placed = [_route_turn(router, _chat(f"System prompt number {i}. " * 40, "hi"), loads=(0, 0, 0), eligible=(0, 1, 2))
              for i in range(300)]
    assert all(80 <= placed.count(i) <= 120 for i in range(3)), [placed.count(i) for i in range(3)]
    # The rank follows the servers' names, not their order on the command line.
    chat = _chat("A system prompt of its own, long enough to count. " * 10, "hi")
    flipped = Router(3, RouterConfig(placement="hash"), names=names[::-1])
    assert names[_route_turn(Router(3, RouterConfig(placement="hash"), names=names), chat, (0, 0, 0), (0, 1, 2))] \
        == names[::-1][_route_turn(flipped, chat, (0, 0, 0), (0, 1, 2))]
    # Its first-ranked server over 1.25x the average load once it takes it: the next one ranked.
    first = _route_turn(Router(3, RouterConfig(placement="hash"), names=names), chat, (0, 0, 0), (0, 1, 2))
    loads = [2, 2, 2]
    loads[first] = 6
    assert _route_turn(Router(3, RouterConfig(placement="hash"), names=names), chat, loads, (0, 1, 2)) != first


def test_routing_keys_keep_a_chats_prefix_and_tell_adapters_apart():
    one, two = routing_key(_chat(SYSTEM_A, "q")), routing_key(_chat(SYSTEM_A, "q", "a", "q2"))
    assert two.startswith(one[:-2])  # the next turn's JSON starts as the last one's did
    assert routing_key(_chat(SYSTEM_A, "q", lora_path="sql")) != one
    assert routing_key(EngineRequest({}, input_ids=[1, 2, 3])).endswith("1,2,3")
    assert routing_key(EngineRequest({}, input_embeds=[[0.0]])) == ""  # no key: least loaded
    router = Router(3)
    assert _route(router, EngineRequest({}, input_embeds=[[0.0]]), loads=(2, 0, 1), eligible=(0, 1, 2)) == 1


def test_the_routers_memory_is_bounded():
    router = Router(2, RouterConfig(max_chunks=10))
    assert router.memory.entries == 4 * WAYS  # 20 asked: whole buckets, a power of two of them
    for i in range(50):
        router.choose(f"{i:04d}" * CHUNK_BYTES, [0, 0], [0, 1])  # 4 chunks each
    assert sum(router.memory.count(i) for i in range(2)) <= router.memory.entries
    # The latest prompts are remembered; the first ones gave way.
    latest, first = (chunk_hashes(f"{i:04d}" * CHUNK_BYTES) for i in (49, 0))
    assert max(router.memory.matched(router.memory.lookup(latest), [0, 1])) == 4
    assert router.memory.matched(router.memory.lookup(first), [0, 1]) == [0, 0]


def test_chunk_hashes_cover_the_prompt_up_to_each_chunk_and_are_the_same_in_every_process():
    text = "The quick brown fox jumps over the lazy dog; 彼は走った. " * 12
    hashes = chunk_hashes(text)
    assert len(hashes) == len(text.encode()) // CHUNK_BYTES
    # A prompt that differs from chunk 3 on shares the first three hashes only.
    changed = text.encode()[:3 * CHUNK_BYTES] + b"X" + text.encode()[3 * CHUNK_BYTES + 1:]
    other = chunk_hashes(changed.decode(errors="surrogateescape"))
    assert (hashes[:3] == other[:3]).all() and not (hashes[3:] == other[3:]).any()
    # The same chunks in another order hash apart.
    a, b = "a" * CHUNK_BYTES, "b" * CHUNK_BYTES
    assert chunk_hashes(a + b)[1] != chunk_hashes(b + a)[1]
    assert len(chunk_hashes("short")) == 0
    # Another interpreter (another hash salt) gets the same values.
    import subprocess
    import sys

    code = f"from openai_frontend.router_memory import chunk_hashes; print(list(chunk_hashes({text!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}, cwd=str(Path(__file__).parents[1]))
    assert out.stdout.strip() == str([int(h) for h in hashes]).replace("np.uint64(", "").replace(")", "")


def test_a_shared_memory_file_is_one_table_for_every_process(tmp_path):
    path = str(tmp_path / "router_memory")
    RouterMemory.create_file(path, 3, 3 * 1024)
    one, two = RouterMemory(3, 3 * 1024, path), RouterMemory(3, 3 * 1024, path)
    chat = chunk_hashes("A chat's history so far, long enough for several chunks of it. " * 8)
    one.remember(2, one.lookup(chat))
    assert two.matched(two.lookup(chat), [0, 1, 2]) == [0, 0, len(chat)]
    assert two.matched(two.lookup(chat[:3]), [2]) == [3]
    two.remember(0, two.lookup(chat[:2]))  # a shorter prompt with the same start, sent elsewhere
    assert one.matched(one.lookup(chat), [0, 1, 2]) == [2, 0, len(chat)]
    one.forget(2)
    assert two.matched(two.lookup(chat), [0, 1, 2]) == [2, 0, 0] and one.count(2) == 0
    # A file made for another layout is not mapped: the process keeps a table of its own.
    assert RouterMemory.shared_or_private(2, 3 * 1024, path).path is None
    assert RouterMemory.shared_or_private(3, 3 * 1024, str(tmp_path / "missing")).path is None
    with pytest.raises(ValueError):
        RouterMemory(65, 10)


def test_every_process_balances_by_the_servers_whole_load(tmp_path):
    import subprocess
    import sys

    from openai_frontend.router_memory import MAX_SERVERS

    path = str(tmp_path / "router_memory")
    RouterMemory.create_file(path, 2, 1024)
    one, two = RouterMemory(2, 1024, path), RouterMemory(2, 1024, path)
    one.set_load(0, 5)
    two.set_load(0, 2)
    two.set_load(1, 1)
    assert one.loads([5, 0]) == two.loads([2, 1]) == [7, 1]
    assert RouterMemory(2, 1024).loads([3, 4]) == [3, 4]  # private: this process's own
    # A process killed with requests in flight: its row stops counting once it is seen gone.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    three = RouterMemory(2, 1024, path)
    three._loads[three._row] = [9] * MAX_SERVERS
    three._pids[three._row] = gone.pid
    RouterMemory(2, 1024, path)  # the next process to map the file clears it
    assert one.loads([5, 0]) == [7, 1]

    # A router whose process has nothing in flight still sees the other's 40 requests on the
    # server that holds a prompt's prefix: loads have drifted apart, the other server takes it.
    config = RouterConfig()
    RouterMemory.create_file(path, 2, config.max_chunks * 2)
    busy, idle = (Router(2, config, memory_path=path) for _ in range(2))
    home = _route(busy, _chat(SYSTEM_A, "q"))
    busy.note_load(home, 40)
    assert _route(idle, _chat(SYSTEM_A, "q"), loads=(0, 0)) == 1 - home
    busy.note_load(home, 0)
    assert _route(idle, _chat(SYSTEM_A, "q"), loads=(0, 0)) == home


def test_two_routers_on_one_memory_send_a_chats_turns_to_its_server(tmp_path):
    # Two --workers processes; a chat's turns reach either. A system prompt shared by every chat was
    # sent to server b by the second process (a was busy then).
    shared = "You are the support assistant of a large shop; answer politely, in short sentences. " * 12
    turns = [("Chat 9: my parcel arrived damaged; the box was crushed and the lid broken.",),
             ("Chat 9: my parcel arrived damaged; the box was crushed and the lid broken.", "Sorry!", "Refund?")]

    def homes(path) -> list[int]:
        config = RouterConfig(placement="least_seen")
        if path:
            RouterMemory.create_file(path, 2, config.max_chunks * 2)
        one, two = (Router(2, config, names=["a:8001", "b:8001"], memory_path=path) for _ in range(2))
        two.note_load(0, 40)  # shared: how every process sees it; private: the loads passed below
        for i in range(4):
            assert _route_turn(two, _chat(shared, f"Chat {i}: where is my order?"), loads=(40, 0)) == 1
        two.note_load(0, 0)
        return [_route_turn(one, _chat(shared, *turns[0])), _route_turn(two, _chat(shared, *turns[1])),
                _route_turn(one, _chat(shared, *turns[1]))]

    # One table: the first process sees the system prompt on b and sends the chat there; every
    # later turn follows, whichever process takes it.
    assert homes(str(tmp_path / "router_memory")) == [1, 1, 1]
    # A table each: the first process places the chat on a, the second sends its next turn to b,
    # where only the system prompt is.
    assert homes(None) == [0, 1, 0]


def test_load_aware_shares_a_hot_system_prompt_and_keeps_each_chat_on_its_server():
    shared = "You are the support assistant of a large shop; answer politely, in short sentences. " * 12

    def burst(policy: str) -> tuple[list[int], list[int]]:
        """Eight chats start at once (none finishes), then each sends its next turn."""
        router, loads, homes = Router(2, RouterConfig(policy=policy)), [0, 0], []
        for i in range(8):
            homes.append(_route(router, _chat(shared, f"Chat {i}: where is my order?"), loads=loads))
            loads[homes[-1]] += 1
        later = [_route(router, _chat(shared, f"Chat {i}: where is my order?", "On its way.", "When?"), loads=loads)
                 for i in range(8)]
        return homes, later

    # cache_aware: the system prompt is most of every prompt, so every chat goes where it was seen
    # first, until 32 more are in flight there than on the other server.
    homes, later = burst("cache_aware")
    assert homes == [homes[0]] * 8 and later == homes
    # load_aware: once a server is busier than the mean, the other takes new chats and pays the
    # system prompt once; each chat's next turn stays where its history is.
    homes, later = burst("load_aware")
    assert sorted(homes.count(i) for i in (0, 1)) == [4, 4], homes
    assert later == homes
    # Far busier than the mean, a server gives a chat's turn up, history or not (beta 1: a whole
    # prompt's worth at twice the mean); with beta 0, the cache alone counts.
    router = Router(2, RouterConfig(policy="load_aware"))
    home = _route(router, _chat(shared, "q"))
    loads = [0, 0]
    loads[home] = 10
    assert _route(router, _chat(shared, "q", "a", "q2"), loads=loads) == 1 - home
    cache_only = Router(2, RouterConfig(policy="load_aware", load_beta=0))
    home = _route(cache_only, _chat(shared, "q"))
    loads = [0, 0]
    loads[home] = 10
    assert _route(cache_only, _chat(shared, "q", "a", "q2"), loads=loads) == home


def test_power_of_two_and_random_choose_among_the_eligible():
    p2 = Router(4, RouterConfig(policy="power_of_two"), seed=1)
    picks = {p2.choose("", [5, 0, 5, 5], [0, 1, 2, 3]) for _ in range(50)}
    assert 1 in picks and picks <= {0, 1, 2, 3}
    # The less loaded of the two drawn: the busiest is never taken over another.
    assert 3 not in {p2.choose("", [1, 1, 1, 9], [0, 1, 2, 3]) for _ in range(50)}
    rnd = Router(3, RouterConfig(policy="random"), seed=2)
    assert {rnd.choose("", [0, 0, 0], [0, 2]) for _ in range(30)} == {0, 2}


def test_router_settings_are_checked():
    for bad in ({"policy": "least"}, {"cache_threshold": 1.5}, {"balance_rel_threshold": 0.5}, {"max_chunks": 0},
                {"load_beta": -1},
                {"placement": "sticky"}):
        with pytest.raises(ValueError):
            RouterConfig(**bad)


# --- the client over fake servers -------------------------------------------------------------


class _Result:
    def __init__(self, response, meta=None) -> None:
        self._response, self._meta = response, meta

    def get_response(self):
        return self._response

    def as_numpy(self, name):
        return None if self._meta is None else np.array([json.dumps(self._meta).encode()], dtype=np.object_)


def _unavailable() -> grpc.aio.AioRpcError:
    """What a dead server's stream raises (tritonclient's aio stream passes gRPC's error on)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="failed to connect to all addresses")


def _refused():
    """What a dead server's unary calls raise (tritonclient wraps gRPC's error)."""
    from tritonclient.utils import InferenceServerException

    return InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE")


class FakeTriton:
    """One fake tritonserver: serves the ensemble (two responses per generation) and the llm
    model's control requests; `down` makes every call fail as a dead server's do."""

    def __init__(self, name: str, adapters=None) -> None:
        self.name, self.down = name, False
        self.generations: list[str] = []  # Triton request ids of the generations it got
        self.controls: list[str] = []
        self.adapters = adapters or {}
        self.hold: asyncio.Event | None = None  # set: generations wait for it before answering
        self.pause: asyncio.Event | None = None  # set: generations wait for it after their first response
        self.refuse: str | None = None  # set: generations fail at once with this error message

    async def is_model_ready(self, model_name, client_timeout=None):
        if self.down:
            raise _refused()
        return not self.refuse

    async def get_model_repository_index(self, as_json=False, client_timeout=None):
        if self.down:
            raise _refused()
        return {"models": [{"name": "ensemble", "state": "READY"}]}

    async def get_model_metadata(self, model_name, as_json=False, client_timeout=None):
        from openai_frontend.triton_client import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS

        if self.down:
            raise _refused()
        return {"inputs": [{"name": n} for n in ENSEMBLE_INPUTS], "outputs": [{"name": n} for n in ENSEMBLE_OUTPUTS]}

    async def infer(self, model, inputs, outputs=None, client_timeout=None):
        if self.down:
            raise _refused()
        self.controls.append(f"infer:{model}")
        return type("R", (), {"as_numpy": lambda _, name: np.array([7, 8], dtype=np.int32)})()

    def stream_infer(self, requests, stream_timeout=None):
        return _FakeStream(self, requests)


class _FakeStream:
    def __init__(self, server: FakeTriton, requests) -> None:
        self.server, self.requests, self.items = server, requests, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items is None:
            if self.server.down:
                raise _unavailable()
            payload = await self.requests.__anext__()
            self.items = self._answer(payload)
            self.generation = payload["model_name"] == "ensemble"
            if self.generation and self.server.refuse:
                from tritonclient.utils import InferenceServerException

                self.items = []
                return None, InferenceServerException(self.server.refuse)
            if self.server.hold is not None and self.generation:
                await self.server.hold.wait()
        elif self.generation and self.server.pause is not None:
            await self.server.pause.wait()
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0), None

    def _answer(self, payload) -> list:
        names = [i.name() for i in payload["inputs"]]
        if payload["model_name"] == "ensemble":
            self.server.generations.append(payload["request_id"])
            text = self.server.name
            return [_Result(infer_response({"text_output": text, "output_ids": [1], "finish_reason": "",
                                       "completion_tokens": [1]})),
                    _Result(infer_response({"text_output": "", "output_ids": [], "finish_reason": "length",
                                       "completion_tokens": [1]}, final=True))]
        what = names[0]
        self.server.controls.append(what)
        meta = {"abort_client": {"aborted": 1}, "reset_prefix_cache": {"forgotten_blocks": 3},
                "lora_update": {"loaded_adapters": self.server.adapters},
                "engine_info": {"max_model_len": 64, "stats": {"num_running": 1, "prompt_tokens_total": 10,
                                                               "spec_accepted_per_position": [2, 1]}},
                "abort_request_id": {}}[what]
        return [_Result(infer_response({}, final=True), meta)]

    def cancel(self) -> None:
        pass


def _client(*servers: FakeTriton, **kwargs):
    from openai_frontend.triton_client import TritonLLMClient

    client = TritonLLMClient([f"{s.name}:8001" for s in servers], abort_model="llm", serves_frontend=True, **kwargs)
    for slot, fake in zip(client._servers, servers):
        slot.client = fake
    return client


async def _text(client, request: EngineRequest) -> str:
    return "".join([chunk.text async for chunk in client.generate(request)])


def test_the_client_routes_each_chat_to_its_server_and_counts_load():
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        client = _client(a, b)
        first = await _text(client, _chat(SYSTEM_A, "q"))
        second = await _text(client, _chat(SYSTEM_B, "q"))
        later = [await _text(client, _chat(SYSTEM_A, "q", "r", f"q{i}")) for i in range(3)]
        # In flight: counted per server while the stream runs, back to zero after.
        a.hold = b.hold = asyncio.Event()
        task = asyncio.ensure_future(_text(client, _chat(SYSTEM_B, "q", "r", "again")))
        await asyncio.sleep(0.05)
        during = [s.in_flight for s in client._servers]
        a.hold.set()
        await task
        return first, second, later, during, [s.in_flight for s in client._servers], client.server_counts()

    first, second, later, during, after, counts = asyncio.run(scenario())
    assert {first, second} == {"a", "b"} and later == [first] * 3
    assert sorted(during) == [0, 1] and during[["a", "b"].index(second)] == 1
    assert after == [0, 0]
    # /metrics' routing counts: the later turns found their start where they went.
    home = counts[f"{first}:8001"]
    first_turn = len(chunk_hashes(routing_key(_chat(SYSTEM_A, "q"))))
    assert home["requests"] == 4 and home["prompt_chunks_matched"] >= 3 * (first_turn - 1)  # its last chunk closes the list
    assert home["prompt_chunks"] > home["prompt_chunks_matched"]


def test_clients_sharing_a_router_memory_see_each_others_streams(tmp_path):
    path = str(tmp_path / "router_memory")
    RouterMemory.create_file(path, 2, RouterConfig().max_chunks * 2)
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        one, two = _client(a, b, router_memory_path=path), _client(a, b, router_memory_path=path)
        a.hold = b.hold = asyncio.Event()
        task = asyncio.ensure_future(_text(one, _chat(SYSTEM_A, "q")))
        await asyncio.sleep(0.05)
        during = two.router.memory.loads([0, 0])
        a.hold.set()
        await task
        return during, two.router.memory.loads([0, 0])

    during, after = asyncio.run(scenario())
    assert sorted(during) == [0, 1] and after == [0, 0]


def test_a_dead_server_is_skipped_its_request_retried_and_it_comes_back(monkeypatch):
    from openai_frontend import triton_client

    monkeypatch.setattr(triton_client, "RECHECK_S", 0.05)
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        client = _client(a, b)
        home = await _text(client, _chat(SYSTEM_A, "q"))
        dead = a if home == "a" else b
        dead.down = True
        # Its connection fails before any answer: the request goes to the other server, which
        # takes the next ones too (no time lost on the dead one).
        moved = [await _text(client, _chat(SYSTEM_A, "q")) for _ in range(3)]
        tried_dead = len(dead.generations)
        dead.down = False
        await asyncio.sleep(0.1)
        await _text(client, _chat(SYSTEM_B, "x"))  # routing notices the server may be back: asks it
        await asyncio.sleep(0.05)
        back = await _text(client, _chat(SYSTEM_A, "q"))
        fresh = await _text(client, _chat("A system prompt neither server has seen, long enough to count. " * 4, "n"))
        return home, moved, tried_dead, back, fresh, await client.is_ready()

    home, moved, tried_dead, back, fresh, ready = asyncio.run(scenario())
    other = "b" if home == "a" else "a"
    assert moved == [other] * 3 and tried_dead == 1 and ready
    # What the router remembered of the server that went down was dropped (a server that comes back
    # has most likely restarted, empty): the chat stays where its history moved, and a new one
    # goes to the server that came back.
    assert back == other and fresh == home


def test_every_server_down_fails_the_request_with_a_503():
    a, b = FakeTriton("a"), FakeTriton("b")
    a.down = b.down = True

    async def scenario():
        client = _client(a, b)
        with pytest.raises(APIError) as err:
            await _text(client, _chat(SYSTEM_A, "q"))
        return err.value, await client.is_ready(), await client.not_ready_reason()

    error, ready, reason = asyncio.run(scenario())
    assert error.status_code == 503 and not ready
    assert reason.startswith("a:8001: Triton does not answer") and "; b:8001: Triton does not answer" in reason


def test_control_requests_go_to_every_server():
    a, b = FakeTriton("a", adapters={"sql": "/x"}), FakeTriton("b", adapters={"sql": "/x"})

    async def scenario():
        client = _client(a, b)
        aborted = await client.abort_requests(abort_all=True)
        forgotten = await client.reset_prefix_cache()
        loaded = await client.lora_update({"op": "list"})
        info = await client.engine_info()
        b.adapters = {}  # b restarted: its runtime adapters are gone
        with pytest.raises(APIError) as mismatch:
            await client.lora_update({"op": "load", "name": "sql", "path": "/x"})
        assert await client.lora_update({"op": "list"}) == {}  # only what every server serves
        b.down = True  # one server gone: the others answer; an update that must reach all fails
        partial = await client.reset_prefix_cache()
        assert await client.lora_update({"op": "list"}) == {"sql": "/x"}
        with pytest.raises(APIError) as gone:
            await client.lora_update({"op": "unload", "name": "sql"})
        tokens = await client.tokenize(EngineRequest({}, text_input="hi"))
        a.down, b.down = True, False  # tokenizing is idempotent: a failed connection tries another server
        retried = await client.tokenize(EngineRequest({}, text_input="hi"))
        assert b.controls[-1] == "infer:preprocessing" and client._servers[0].ready is False
        return aborted, forgotten, loaded, info, mismatch.value, partial, gone.value, tokens + retried

    aborted, forgotten, loaded, info, mismatch, partial, gone, tokens = asyncio.run(scenario())
    assert aborted == 2 and forgotten == 6 and loaded == {"sql": "/x"}
    assert info["max_model_len"] == 64 and "url" not in info
    assert info["stats"] == {"num_running": 2, "prompt_tokens_total": 20, "spec_accepted_per_position": [4, 2]}
    assert [d["url"] for d in info["data_parallel"]] == ["a:8001", "b:8001"]
    assert mismatch.status_code == 500 and "b:8001: none" in mismatch.message
    assert partial == 3
    assert gone.status_code == 503 and gone.message.startswith("b:8001: ")
    assert tokens == [7, 8] * 2 and a.controls[-1] == "infer:preprocessing"


def test_an_abort_by_rid_reaches_the_server_that_runs_it():
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        client = _client(a, b)
        await _text(client, _chat(SYSTEM_A, "warm a"))
        await _text(client, _chat(SYSTEM_B, "warm b"))
        hold = a.hold = b.hold = asyncio.Event()
        request = _chat(SYSTEM_A, "warm a", "x", "long one")
        request.request_id, request.client_named = "mine", True
        task = asyncio.ensure_future(_text(client, request))
        await asyncio.sleep(0.05)
        # A second request under the same rid is refused whichever server it would go to.
        twin = _chat(SYSTEM_B, "other")
        twin.request_id, twin.client_named = "mine", True
        with pytest.raises(APIError, match="Duplicate request ID"):
            await _text(client, twin)
        stream = next(iter(client._open.values()))
        await client.abort_requests(rid="mine")
        hold.set()
        await task
        return stream.server.url

    url = asyncio.run(scenario())
    runs_it, other = (a, b) if url == "a:8001" else (b, a)
    assert "abort_request_id" in runs_it.controls and "abort_request_id" not in other.controls
    assert "abort_client" in runs_it.controls and "abort_client" in other.controls


def test_a_server_whose_model_is_not_ready_is_skipped_like_a_dead_one():
    # A restarted tritonserver answers before its models are loaded: Triton's "unknown model".
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        client = _client(a, b)
        home = await _text(client, _chat(SYSTEM_A, "q"))
        loading = a if home == "a" else b
        loading.refuse = "Request for unknown model: 'ensemble' is not found"
        moved = await _text(client, _chat(SYSTEM_A, "q"))
        return home, moved, loading.generations, [s.ready for s in client._servers]

    home, moved, tried, ready = asyncio.run(scenario())
    assert moved != home and len(tried) == 2  # its first, then the refused one
    assert ready[["a", "b"].index(home)] is False


def test_closing_a_routed_stream_aborts_its_request_before_close_returns():
    # The handlers close a stream early (a disconnect, n > 1 merging, best_of): the engine's abort
    # must go out then, not when the inner stream is collected.
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        client = _client(a, b)
        a.pause = b.pause = asyncio.Event()
        stream = client.generate(_chat(SYSTEM_A, "q"))
        first = await stream.__anext__()
        await stream.aclose()
        aborts = [c for fake in (a, b) for c in fake.controls if c == "abort_request_id"]
        return first.text, aborts, [s.in_flight for s in client._servers]

    text, aborts, in_flight = asyncio.run(scenario())
    assert text in ("a", "b") and aborts == ["abort_request_id"] and in_flight == [0, 0]


def test_a_model_seen_unavailable_mid_run_is_read_again_when_it_returns():
    # A reload under the same name that no /health call saw: the stream that met it says so, and
    # the model's tensors are read again (here it came back as one the frontend cannot call).
    server = FakeTriton("a")

    async def scenario():
        client = _client(server)
        first = await _text(client, _chat(SYSTEM_A, "q"))
        server.refuse = "Request for unknown model: 'ensemble' is not found"
        with pytest.raises(APIError) as gone:
            await _text(client, _chat(SYSTEM_A, "q"))
        server.refuse = None
        server.get_model_metadata = _llm_metadata
        with pytest.raises(APIError) as changed:
            await _text(client, _chat(SYSTEM_A, "q"))
        return first, gone.value, changed.value

    first, gone, changed = asyncio.run(scenario())
    assert first == "a" and gone.status_code == 503
    assert changed.status_code == 500 and "not one this frontend can call" in changed.message


async def _llm_metadata(model_name, as_json=False, client_timeout=None):
    return {"inputs": [{"name": "input_ids"}], "outputs": [{"name": "output_ids"}]}


def test_two_frontend_processes_with_hash_placement_send_a_chats_turns_to_one_server():
    a, b = FakeTriton("a"), FakeTriton("b")

    async def scenario():
        one, two = (_client(a, b, router=RouterConfig(placement="hash")) for _ in range(2))
        for i in range(4):  # the second process has seen other chats, and so has its memory
            await _text(two, _chat(f"Other chat {i}. " * 30, "hi"))
        return [await _text(worker, _chat(SYSTEM_A, *turns)) for worker, turns in
                ((one, ("q",)), (two, ("q", "r", "q2")), (one, ("q", "r", "q2", "s", "q3")))]

    homes = asyncio.run(scenario())
    assert len(set(homes)) == 1, homes
