"""vLLM's thinking_token_budget in the engine (backend/thinking_budget.py): at most N tokens inside
the reasoning section, then its closing marker is forced."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParamsError, ThinkingBudget, parse_sampling_params
from backend.thinking_budget import ThinkingBudgetProcessor

IDS = {"<think>": [5], "</think>": [7, 8]}


def forced(proc: ThinkingBudgetProcessor, output: list[int]):
    """The one id the processor forces after `output`, or None when it leaves the row alone."""
    row = proc([], output, torch.zeros(16))
    if bool(torch.isfinite(row).all()):
        return None
    allowed = torch.isfinite(row).nonzero().flatten().tolist()
    assert len(allowed) == 1
    return allowed[0]


def test_the_closing_marker_is_forced_after_the_budget_inside_the_section():
    proc = ThinkingBudgetProcessor(ThinkingBudget(budget=3, starts=["<think>"], end="</think>", inside=True), IDS.get)
    out: list[int] = []
    for token in (1, 2, 3):
        assert forced(proc, out) is None
        out.append(token)
    assert forced(proc, out) == 7
    out.append(7)
    assert forced(proc, out) == 8
    out.append(8)
    assert forced(proc, out) is None  # the section is closed: the answer is free
    out += [1] * 10
    assert forced(proc, out) is None


def test_the_budget_counts_from_the_opening_marker_and_a_natural_close_ends_it():
    spec = ThinkingBudget(budget=2, starts=["<think>"], end="</think>")
    proc = ThinkingBudgetProcessor(spec, IDS.get)
    assert forced(proc, [1, 2, 3, 4]) is None  # no section opened: nothing counted
    assert forced(proc, [1, 2, 3, 4, 5, 1]) is None
    assert forced(proc, [1, 2, 3, 4, 5, 1, 2]) == 7
    closed = ThinkingBudgetProcessor(spec, IDS.get)
    assert forced(closed, [5, 1, 7, 8]) is None  # closed by the model within its budget
    assert forced(closed, [5, 1, 7, 8, 1, 1, 1]) is None
    # The marker's first ids, written by the model, are not counted: forcing goes on from them.
    partial = ThinkingBudgetProcessor(ThinkingBudget(budget=1, starts=["<think>"], end="</think>", inside=True),
                                      IDS.get)
    assert forced(partial, [7]) is None
    assert forced(partial, [7, 7]) == 8
    zero = ThinkingBudgetProcessor(ThinkingBudget(budget=0, starts=["<think>"], end="</think>", inside=True), IDS.get)
    assert forced(zero, []) == 7  # no thinking at all


def test_the_state_follows_the_output_alone():
    # A preempted sequence is recomputed: the processor may see an output it has not followed.
    spec = ThinkingBudget(budget=2, starts=["<think>"], end="</think>", inside=True)
    proc = ThinkingBudgetProcessor(spec, IDS.get)
    assert forced(proc, [1, 2, 7]) == 8
    assert forced(proc, [1]) is None  # shorter: followed again from the start
    assert forced(proc, [1, 2]) == 7
    fresh = ThinkingBudgetProcessor(spec, IDS.get)
    assert forced(fresh, [1, 2, 7]) == 8  # a whole output at once


def test_thinking_budget_parameters_are_checked():
    ok = parse_sampling_params({"thinking_budget": {"budget": 4, "starts": ["<think>"], "end": "</think>"}})
    assert ok.thinking_budget.budget == 4 and not ok.thinking_budget.inside and ok.processes_rows
    for bad in ({"budget": -1, "starts": ["a"], "end": "b"}, {"budget": 1, "starts": [], "end": "b"},
                {"budget": 1, "starts": ["a"], "end": ""}, {"budget": 1, "starts": ["a"], "end": "b", "x": 1},
                {"budget": "1", "starts": ["a"], "end": "b"}):
        with pytest.raises(SamplingParamsError, match="thinking_budget"):
            parse_sampling_params({"thinking_budget": bad})


@pytest.fixture(scope="module")
def engine(demo_model_path):
    return LLMEngine(EngineConfig(model_path=str(demo_model_path), device="cpu", num_kv_blocks=64, block_size=16,
                                  max_model_len=256))


def test_the_engine_forces_the_marker_after_the_budget(engine):
    prompt = engine.tokenizer.encode("Think about it.", add_special_tokens=False)
    marker = engine.tokenizer.encode("</think>", add_special_tokens=False)
    base = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    budget = {"budget": 5, "starts": ["<think>"], "end": "</think>", "inside": True}
    free, limited, outside = engine.generate([prompt] * 3, [
        parse_sampling_params(base), parse_sampling_params({**base, "thinking_budget": budget}),
        parse_sampling_params({**base, "thinking_budget": {**budget, "inside": False}})])
    assert marker and marker != free.new_token_ids[5:5 + len(marker)]
    assert limited.new_token_ids[:5] == free.new_token_ids[:5]
    assert limited.new_token_ids[5:5 + len(marker)] == marker
    assert len(limited.new_token_ids) == 24 and "</think>" in limited.text
    # The section never opened (the random model writes no <think>): the output is untouched.
    assert outside.new_token_ids == free.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
