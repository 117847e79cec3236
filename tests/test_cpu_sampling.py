"""The C++ CPU sampling ops (kernels/csrc/sampling_cpu.cpp) against the torch reference: the same
penalized logits bit for bit, the same bitmasked tokens, the same tokens surviving the filter,
and the same token drawn for a seed, on every row of random batches with ties, -inf tokens,
every filter's edge values, and seeds and offsets over the full 64-bit range."""

import pytest
import torch

import kernels
from kernels import cpu_sampling
from kernels import reference as ref

NEG_INF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_sampling.load() is not None, cpu_sampling.error()


def _batch(seed: int, B: int, V: int, ties: bool, masked: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * (0.3 + 4 * torch.rand(B, 1, generator=g))
    if ties:
        x = (x * 2).round() / 2  # few distinct values: ties at every threshold
    if masked:
        x[:, ::3] = NEG_INF  # a grammar or an earlier filter removed these
        x[0] = NEG_INF  # nothing allowed
    top_k = torch.randint(-1, V + 2, (B,), generator=g, dtype=torch.int32)
    top_k[::4] = 0
    top_k[1::4] = min(20, V)
    top_p = torch.rand(B, generator=g)
    top_p[::3] = 1.0
    top_p[2::7] = 0.0
    min_p = torch.rand(B, generator=g) * 0.4
    min_p[::2] = 0.0
    min_p[5::11] = 1.5
    seeds = torch.randint(-(2**63), 2**63 - 1, (B,), generator=g)
    offsets = torch.randint(0, 2**40, (B,), generator=g)
    greedy = torch.rand(B, generator=g) < 0.2
    return x, top_k, top_p, min_p, seeds, offsets, greedy


CASES = [(seed, B, V, ties, masked) for seed, (B, V) in enumerate([(64, 4096), (33, 1000), (8, 32000), (5, 1), (3, 2)])
         for ties in (False, True) for masked in (False, True)]


@pytest.mark.parametrize("seed,B,V,ties,masked", CASES)
def test_filter_keeps_what_the_reference_keeps(seed, B, V, ties, masked):
    x, top_k, top_p, min_p, *_ = _batch(seed, B, V, ties, masked)
    want = ref.top_k_top_p_min_p(x, top_k, top_p, min_p)
    got = cpu_sampling.top_k_top_p_min_p(x, top_k, top_p, min_p)
    assert torch.equal(got, want), f"rows differ: {(got != want).any(1).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_top_p_walks_as_far_as_the_mass_needs(scale):
    # Flat rows need most of a 32k vocabulary before top-p's mass is reached (the candidate set
    # grows several times), peaked ones a handful; ties at 0.5 steps make huge groups.
    g = torch.Generator().manual_seed(int(scale * 100))
    x = torch.randn(6, 32000, generator=g) * scale
    x[3:] = (x[3:] * 2).round() / 2
    top_p = torch.tensor([0.999, 0.5, 0.9, 0.999, 0.3, 0.95])
    k, m = torch.zeros(6, dtype=torch.int32), torch.zeros(6)
    assert torch.equal(cpu_sampling.top_k_top_p_min_p(x, k, top_p, m), ref.top_k_top_p_min_p(x, k, top_p, m))


@pytest.mark.parametrize("seed,B,V,ties,masked", CASES)
def test_draw_is_the_reference_draw(seed, B, V, ties, masked):
    x, top_k, top_p, min_p, seeds, offsets, greedy = _batch(seed, B, V, ties, masked)
    filtered = ref.top_k_top_p_min_p(x, top_k, top_p, min_p)
    for logits in (x, filtered):  # noise for every token, and only for the survivors
        want = ref.sample(logits, seeds, offsets, greedy)
        got = cpu_sampling.sample(logits, seeds, offsets, greedy)
        assert torch.equal(got, want), f"rows differ: {(got != want).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("B,V", [(64, 4096), (7, 1001), (3, 1)])
@pytest.mark.parametrize("which", ["all", "repetition", "frequency", "presence", "none"])
def test_penalties_round_as_the_reference(B, V, which):
    g = torch.Generator().manual_seed(B * V)
    x = torch.randn(B, V, generator=g) * 5
    x[:, ::11] = NEG_INF
    x[:, 1::13] = 0.0
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32) * (torch.rand(B, V, generator=g) < 0.1)
    prompt = torch.rand(B, V, generator=g) < 0.05
    freq, pres = torch.randn(B, generator=g), torch.randn(B, generator=g)
    rep = 1.0 + torch.rand(B, generator=g)
    freq[::3], pres[1::3], rep[2::3] = 0.0, 0.0, 1.0  # rows where a penalty is off among rows where it is on
    if which != "all":
        freq = freq if which == "frequency" else torch.zeros(B)
        pres = pres if which == "presence" else torch.zeros(B)
        rep = rep if which == "repetition" else torch.ones(B)
    want = ref.apply_penalties(x, counts, prompt, freq, pres, rep)
    got = cpu_sampling.apply_penalties(x, counts, prompt, freq, pres, rep)
    assert torch.equal(got, want)
    assert got.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("B,V", [(64, 4096), (7, 1001), (3, 1)])
def test_penalties_read_by_slot_equal_the_reference_on_the_gathered_rows(B, V):
    """penalized_argmax, and apply_penalties_by_slot_ in place, read each row's statistics from
    the engine's [slots, V] tables by slot (-1: none)."""
    g = torch.Generator().manual_seed(B + V)
    x = torch.randn(B, V, generator=g) * 3
    x[:, ::9] = NEG_INF
    x[1] = 0.0  # all tied: the lowest index
    S = B + 3  # tables have more slots than the batch uses, in another order
    counts = torch.randint(0, 4, (S, V), generator=g, dtype=torch.int32) * (torch.rand(S, V, generator=g) < 0.2)
    prompt = torch.rand(S, V, generator=g) < 0.1
    slots = torch.randperm(S, generator=g)[:B]
    slots[::4] = -1  # rows without penalties
    freq, pres = torch.rand(B, generator=g), torch.rand(B, generator=g)
    rep = 1.0 + torch.rand(B, generator=g) * 2
    freq[::3], pres[1::3], rep[2::3] = 0.0, 0.0, 1.0
    taken = slots.clamp(min=0)
    unpenalized = slots < 0
    want = ref.apply_penalties(x, counts[taken], prompt[taken], torch.where(unpenalized, 0.0, freq),
                               torch.where(unpenalized, 0.0, pres), torch.where(unpenalized, 1.0, rep)).argmax(dim=1)
    got = cpu_sampling.penalized_argmax(x, counts, prompt, slots, freq, pres, rep)
    assert torch.equal(got, want)
    in_place = x.clone()
    cpu_sampling.apply_penalties_by_slot_(in_place, counts, prompt, slots, freq, pres, rep)
    assert torch.equal(in_place, ref.apply_penalties(x, counts[taken], prompt[taken], torch.where(unpenalized, 0.0, freq),
                                                     torch.where(unpenalized, 0.0, pres), torch.where(unpenalized, 1.0, rep)))
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_sampling.penalized_argmax(x, counts, prompt, torch.full((B,), S), freq, pres, rep)


@pytest.mark.parametrize("B,V", [(64, 4096), (9, 151936), (4, 100)])
def test_penalties_over_the_seen_tokens_equal_the_dense_pass(B, V):
    """With each slot's distinct seen ids, rows that have seen few tokens visit only those; the
    logits come out bit for bit as from the pass over the whole vocabulary (rows that have seen
    many take that pass)."""
    g = torch.Generator().manual_seed(B * 7 + V)
    x = torch.randn(B, V, generator=g) * 3
    x[:, ::9] = NEG_INF
    S = B + 2
    counts = torch.zeros(S, V, dtype=torch.int32)
    prompt = torch.zeros(S, V, dtype=torch.bool)
    seen = torch.zeros(S, V, dtype=torch.int32)
    seen_len = torch.zeros(S, dtype=torch.int64)
    for slot in range(S):
        many = slot % 5 == 0  # some slots have seen a large share of the vocabulary: the dense pass
        n = max(1, V // 3 if many else min(300, V // 10))
        ids = torch.randperm(V, generator=g)[:n]
        out_ids, prompt_ids = ids[: n // 2 + 1], ids[n // 3 :]  # overlapping: seen in both
        counts[slot, out_ids] = torch.randint(1, 5, (out_ids.numel(),), generator=g, dtype=torch.int32)
        prompt[slot, prompt_ids] = True
        seen[slot, :n] = ids.to(torch.int32)
        seen_len[slot] = n
    slots = torch.randperm(S, generator=g)[:B]
    slots[::4] = -1
    freq, pres = torch.rand(B, generator=g), torch.rand(B, generator=g)
    rep = 1.0 + torch.rand(B, generator=g) * 2
    freq[::3], pres[1::3], rep[2::3] = 0.0, 0.0, 1.0
    dense, sparse = x.clone(), x.clone()
    cpu_sampling.apply_penalties_by_slot_(dense, counts, prompt, slots, freq, pres, rep)
    cpu_sampling.apply_penalties_by_slot_(sparse, counts, prompt, slots, freq, pres, rep, seen=(seen, seen_len))
    assert torch.equal(sparse, dense)
    assert not torch.equal(dense, x)
    with pytest.raises(RuntimeError, match="seen token id out of range"):
        bad = seen.clone()
        bad[slots[1], 0] = V
        cpu_sampling.apply_penalties_by_slot_(x.clone(), counts, prompt, slots, freq, pres, rep, seen=(bad, seen_len))


@pytest.mark.parametrize("B,V,words", [(16, 4096, 128), (5, 1000, 32), (4, 100, 2), (3, 70, 4)])
def test_bitmask_blocks_what_the_reference_blocks(B, V, words):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(B, V, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, words), generator=g, dtype=torch.int32)
    rows = torch.rand(B, generator=g) < 0.7
    assert torch.equal(cpu_sampling.apply_token_bitmask(x, bitmask, rows), ref.apply_token_bitmask(x, bitmask, rows))


def test_a_rows_draw_does_not_depend_on_its_batch():
    x, top_k, top_p, min_p, seeds, offsets, greedy = _batch(7, 16, 4096, False, False)
    filtered = cpu_sampling.top_k_top_p_min_p(x, top_k, top_p, min_p)
    together = cpu_sampling.sample(filtered, seeds, offsets, greedy)
    for b in (0, 5, 15):
        alone = cpu_sampling.sample(filtered[b : b + 1], seeds[b : b + 1], offsets[b : b + 1], greedy[b : b + 1])
        assert alone.item() == together[b].item()
        assert torch.equal(cpu_sampling.top_k_top_p_min_p(x[b : b + 1], top_k[b : b + 1], top_p[b : b + 1],
                                                          min_p[b : b + 1]), filtered[b : b + 1])


def test_draws_follow_the_distribution():
    # 20k draws from one row over 4 tokens: frequencies within 1.5% of softmax.
    logits = torch.tensor([[0.0, 1.0, 2.0, NEG_INF]]).repeat(20000, 1)
    seeds = torch.full((20000,), 1234, dtype=torch.int64)
    tokens = cpu_sampling.sample(logits, seeds, torch.arange(20000), torch.zeros(20000, dtype=torch.bool))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0], dim=0), atol=0.015, rtol=0)


def test_kernels_dispatch_cpu_tensors_to_it_unless_switched_off(monkeypatch):
    x, top_k, top_p, min_p, seeds, offsets, greedy = _batch(3, 4, 64, False, False)
    calls = []
    monkeypatch.setattr(ref, "sample", lambda *a: calls.append("reference") or torch.zeros(4, dtype=torch.int64))
    kernels.sample(x, seeds, offsets, greedy, use_triton=False)
    assert calls == []
    monkeypatch.setenv("LLM_CPU_SAMPLING", "0")
    kernels.sample(x, seeds, offsets, greedy, use_triton=False)
    assert calls == ["reference"]


def test_nan_logits_do_not_crash_the_server_process():
    # NaN logits are outside the contract (a broken model), but the ops run inside tritonserver's
    # model process: they must return, not read out of bounds in a selection over NaNs.
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 5000, generator=g)
    x[:, ::3] = float("nan")
    x[5] = float("nan")
    k = torch.tensor([0, 20, 0, 5, 100, 20, 0, 1], dtype=torch.int32)
    p = torch.tensor([0.9, 0.8, 1.0, 0.5, 0.99, 0.8, 0.3, 1.0])
    out = cpu_sampling.top_k_top_p_min_p(x, k, p, torch.zeros(8))
    tokens = cpu_sampling.sample(out, torch.arange(8), torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.bool))
    assert out.shape == x.shape and ((tokens >= 0) & (tokens < 5000)).all()
    # Fewer comparable tokens than top_k (QA: an adapter with NaN weights): top-k keeps every
    # finite one. Its selection read past the candidates it had and crashed tritonserver's stub.
    x = torch.full((2, 5000), float("nan"))
    x[:, [7, 70, 700]] = torch.tensor([1.0, 2.0, 3.0])
    out = cpu_sampling.top_k_top_p_min_p(x, torch.tensor([20, 20], dtype=torch.int32), torch.tensor([1.0, 0.9]),
                                         torch.zeros(2))
    assert out[0].isfinite().nonzero().flatten().tolist() == [7, 70, 700]
    tokens = cpu_sampling.sample(out, torch.arange(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool))
    assert ((tokens >= 0) & (tokens < 5000)).all()


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="one top_k"):
        cpu_sampling.top_k_top_p_min_p(x, torch.zeros(3, dtype=torch.int32), torch.ones(2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_sampling.sample(x.double(), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.bool))


def test_kernels_build_in_the_checkout_and_a_dead_builds_lock_is_removed(tmp_path, monkeypatch, caplog):
    """QA: torch's shared cache kept the lock of a build killed mid-way (a CI clone stopped), and
    serve.sh then waited on it forever, silently. Then a build started right after one was killed
    (a test run interrupted and restarted) still waited forever: the lock was too young for the
    old mtime rule, and a waiter never looked again."""
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path

    from kernels import cpu_build

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    module = cpu_sampling.load()
    if module is None:
        pytest.skip(f"no C++ build here: {cpu_sampling.error()}")
    assert Path(module.__file__).resolve().is_relative_to(cpu_build.BUILD_ROOT.resolve())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpu_build.build_directory("k")
    assert directory == tmp_path / "k" and directory.is_dir()
    lock = directory / "lock"
    lock.touch()  # just left by a killed build: no one holds the guard
    with caplog.at_level("WARNING", logger="kernels.cpu_build"):
        with cpu_build.build_guard(directory):
            assert not lock.exists()
    assert "never finished" in caplog.text

    # A build in progress elsewhere: the guard waits for it, and takes over once it dies.
    builder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from kernels import cpu_build\n"
         "d = Path(sys.argv[1])\nwith cpu_build.build_guard(d):\n (d / 'lock').touch(); print('building', flush=True); "
         "time.sleep(60)", str(directory)],
        cwd=Path(cpu_build.__file__).parent.parent, stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "building"
        entered = threading.Event()

        def build() -> None:
            with cpu_build.build_guard(directory):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(1.0) and lock.exists()  # a live build's lock is its own
        builder.send_signal(signal.SIGKILL)
        assert entered.wait(10.0), "the guard still waits on a dead build"
        waiter.join(5)
        assert not lock.exists()
    finally:
        builder.kill()
        builder.wait()
