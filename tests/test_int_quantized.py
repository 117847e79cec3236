"""GPTQ and AWQ checkpoints (backend/int_quantized.py): packed 4- and 8-bit weights load as their
dequantized values. The checkpoints are packed here the way AutoGPTQ and AutoAWQ pack them (their
loops, written out independently of the loader's unpacking), from the FP8 tests' tiny Qwen2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backend.int_quantized import AWQ_ORDER, dequantize_awq, dequantize_gptq
from backend.model_runner import ModelConfig
from tests.test_engine import mixed_step
from tests.test_fp8_checkpoint import LINEARS, _generate, _prompts, _runner, _write, tiny_qwen2


@pytest.fixture(scope="module")
def base_dir(demo_model_path, tmp_path_factory):
    return tiny_qwen2(demo_model_path, tmp_path_factory.mktemp("int_base"))


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def _quantize(w: torch.Tensor, bits: int, group_size: int, g_idx: torch.Tensor, sym: bool):
    """(q [in, out], zeros [groups, out], fp16 scales [groups, out], the dequantized [out, in])."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w.shape[0])
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            scales[g] = torch.maximum(-lo, hi) * 2 / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (hi - lo) / maxq
            zeros[g] = torch.round(-lo / scales[g]).clamp(0, maxq).long()
    scales = scales.clamp(min=1e-4).half()
    s, z = scales.float()[g_idx], zeros[g_idx]  # per input row
    q = torch.round(w.t() / s + z).clamp(0, maxq).long()
    return q, zeros, scales, ((q - z).float() * s).t().contiguous()


def _pack_gptq(q: np.ndarray, zeros: np.ndarray, bits: int, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: input rows into qweight words, output columns into qzeros'
    (the "gptq" format stores zero - 1)."""
    per = 32 // bits
    qweight = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= q[row * per + j] << (bits * j)
    stored = zeros if v2 else zeros - 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j] << (bits * j)
    return _int32(qweight), _int32(qzeros)


def _pack_awq(values: np.ndarray) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing: eight output columns a word, nibble i holding column
    ORDER[i] of its eight."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.int64)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
    return _int32(packed)


SCHEMES = {
    "gptq4": dict(method="gptq", bits=4, group=32, act_order=False, v2=False),
    "gptq4_act_order": dict(method="gptq", bits=4, group=32, act_order=True, v2=False),
    "gptq8_one_group": dict(method="gptq", bits=8, group=-1, act_order=False, v2=False),
    "gptq4_v2_asym": dict(method="gptq", bits=4, group=32, act_order=False, v2=True),
    "awq": dict(method="awq", bits=4, group=32, act_order=False, v2=True),
}


def _int_pair(base_dir, tmp_path, scheme: str):
    """A GPTQ / AWQ checkpoint of the base model, and a float32 one holding its dequantized weights."""
    spec = SCHEMES[scheme]
    bits, group = spec["bits"], spec["group"]
    raw = load_file(str(base_dir / "model.safetensors"))
    packed, ref = dict(raw), dict(raw)
    g = torch.Generator().manual_seed(3)
    for name, w in raw.items():
        if not (name.endswith(".weight") and any(f".{lin}." in name for lin in LINEARS)):
            continue
        rows = w.shape[1]
        size = group if group > 0 else rows
        g_idx = torch.arange(rows) // size
        if spec["act_order"]:  # act-order: the groups follow a permutation of the input rows
            g_idx = g_idx[torch.randperm(rows, generator=g)]
        q, zeros, scales, deq = _quantize(w, bits, size, g_idx, sym=not spec["v2"])
        stem = name[: -len("weight")]
        del packed[name]
        if spec["method"] == "gptq":
            packed[stem + "qweight"], packed[stem + "qzeros"] = _pack_gptq(q.numpy(), zeros.numpy(), bits, spec["v2"])
            if spec["act_order"]:
                packed[stem + "g_idx"] = g_idx.to(torch.int32)
            if stem + "bias" not in packed:  # AutoGPTQ saves a zero bias where the model has none
                packed[stem + "bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        else:
            packed[stem + "qweight"], packed[stem + "qzeros"] = _pack_awq(q.numpy()), _pack_awq(zeros.numpy())
        packed[stem + "scales"] = scales
        ref[name] = deq
    if spec["method"] == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": spec["act_order"],
                 "sym": not spec["v2"], **({"checkpoint_format": "gptq_v2"} if spec["v2"] else {})}
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    _write(base_dir, tmp_path / "int", packed, quant)
    _write(base_dir, tmp_path / "ref", ref)
    return tmp_path / "int", tmp_path / "ref"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_int_weights_load_as_their_dequantized_values(base_dir, tmp_path, scheme):
    """A step's logits are bit for bit those of a float32 checkpoint holding the same weights,
    dequantized here from the integers before they were packed (a column order, a group or a
    zero point read wrong would differ); greedy outputs agree."""
    int_dir, ref_dir = _int_pair(base_dir, tmp_path, scheme)
    logits = mixed_step(_runner(int_dir))[1]
    assert torch.equal(logits, mixed_step(_runner(ref_dir))[1])
    prompts = _prompts(3, seed=4)
    assert _generate(int_dir, prompts) == _generate(ref_dir, prompts)


def test_unpacking_round_trips_random_words():
    """Every bit of a word lands in one value: random packed words unpack and pack back."""
    g = torch.Generator().manual_seed(1)
    for bits in (2, 4, 8):
        per = 32 // bits
        q = torch.randint(0, 2 ** bits, (4 * per, 16), generator=g)
        zeros = torch.randint(1, 2 ** bits, (2, 16), generator=g)
        qweight, qzeros = _pack_gptq(q.numpy(), zeros.numpy(), bits, v2=False)
        scales = torch.ones(2, 16, dtype=torch.float16)
        g_idx = torch.arange(q.shape[0]) // (2 * per)
        w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits, 2 * per)
        assert torch.equal(w, (q - zeros[g_idx]).float().t())
    q = torch.randint(0, 16, (32, 24), generator=g)
    zeros = torch.randint(0, 16, (1, 24), generator=g)
    w = dequantize_awq(_pack_awq(q.numpy()), _pack_awq(zeros.numpy()), torch.ones(1, 24, dtype=torch.float16), -1)
    assert torch.equal(w, (q - zeros).float().t())


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 8}, "AWQ with 8 bits"),
])
def test_int_layouts_it_cannot_read_are_refused_by_name(base_dir, tmp_path, quant, match):
    _write(base_dir, tmp_path / "q", load_file(str(base_dir / "model.safetensors")), quant)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_model_dir(tmp_path / "q")


def test_a_packed_weight_without_its_zeros_is_refused(base_dir, tmp_path):
    int_dir, _ = _int_pair(base_dir, tmp_path, "gptq4")
    raw = load_file(str(int_dir / "model.safetensors"))
    del raw["model.layers.1.mlp.down_proj.qzeros"]
    _write(int_dir, tmp_path / "broken", raw, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj.qweight' lacks its qzeros or scales"):
        _runner(tmp_path / "broken")
