"""FP8 checkpoints: their weights in the model's dtype, and their KV-cache scales (GPTQ and AWQ
checkpoints are read by backend/int_quantized.py, through the same two calls).

FP8 exports (llm-compressor / compressed-tensors, ModelOpt, AutoFP8, the block-wise format of
DeepSeek's and Qwen's "-FP8" releases) store each linear's weight as float8 with a scale:
per tensor, per output channel, or per 2-D block. The runner has no FP8 matmuls, so such a
weight is multiplied out once, at load, into the model's dtype: the checkpoint loads and runs
with the numbers it was calibrated to, at the memory of an unquantized model. Activation scales
(`input_scale`) are dropped: activations stay in the model's dtype.

The same exports carry per-layer K/V scales calibrated for an FP8 KV cache: the cache stores
K / k_scale and V / v_scale, which keeps keys and values larger than e4m3's 448 from
saturating. The runner applies them when it runs an fp8 cache (as vLLM does; with
a wider cache they are not needed and are ignored). Without them, `calculate_kv_scales` measures
scales at start-up on a prefill of CALIBRATION_TEXT (ModelRunner.calibrate_kv_scales).
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch

from backend.int_quantized import INT_METHODS, check_int_quantization, dequantize_int_weights

# quantization_config.quant_method values whose checkpoints are FP8 weights with scales.
FP8_METHODS = ("fp8", "compressed-tensors", "modelopt")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Per-layer K/V scale names, as the exporters write them (vLLM's maybe_remap_kv_scale_name
# reads the same): (pattern, which of k/v it sets). "kv" is the older single scale for both.
_KV_SCALE_NAMES = (
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$"), None),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_proj\.(?:[kv]_scale|output_scale)$"), None),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.kv_scale$"), "kv"),
)


def check_quantization(quant: Optional[dict[str, Any]]) -> None:
    """Refuse a checkpoint quantized in a way the runner cannot load, by name, up front (it
    would otherwise fail later on a missing or unexpected tensor)."""
    if not quant:
        return
    method = quant.get("quant_method", "")
    if method in INT_METHODS:
        check_int_quantization(quant)
        return
    if method not in FP8_METHODS:
        raise ValueError(f"quantization_config.quant_method '{method}' is not supported; FP8 ({', '.join(FP8_METHODS)}) "
                         f"and integer ({', '.join(INT_METHODS)}) checkpoints are, their weights dequantized at load")
    if method == "compressed-tensors":
        for name, group in (quant.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights and (weights.get("type") != "float" or weights.get("num_bits") != 8):
                raise ValueError(f"compressed-tensors group '{name}' quantizes weights to "
                                 f"{weights.get('type')}{weights.get('num_bits')}; only float8 is supported")


def block_size(quant: Optional[dict[str, Any]]) -> Optional[tuple[int, int]]:
    """The 2-D block of block-wise scales: `weight_block_size` (fp8), or a compressed-tensors
    group's `block_structure`."""
    if not quant:
        return None
    if quant.get("weight_block_size"):
        b = quant["weight_block_size"]
        return int(b[0]), int(b[1])
    for group in (quant.get("config_groups") or {}).values():
        structure = (group.get("weights") or {}).get("block_structure")
        if structure:
            if isinstance(structure, str):  # older exports: "128x128"
                structure = structure.lower().split("x")
            return int(structure[0]), int(structure[1])
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """An FP8 weight [out, in] times its scale, in float32. The scale is one number, one per
    output row ([out] or [out, 1]), or one per block ([ceil(out/b0), ceil(in/b1)], the last block
    of a row or column possibly partial)."""
    w = weight.float()
    s = scale.float()
    out, inp = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and (s.dim() == 1 or s.shape[-1] == 1):
        return w * s.reshape(out, 1)
    if s.dim() == 2:
        b0, b1 = block or (math.ceil(out / s.shape[0]), math.ceil(inp / s.shape[1]))
        if s.shape != (math.ceil(out / b0), math.ceil(inp / b1)):
            raise ValueError(f"a block scale of shape {tuple(s.shape)} does not tile a [{out}, {inp}] weight "
                             f"in blocks of {b0}x{b1}")
        return w * s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    raise ValueError(f"a weight scale of shape {tuple(s.shape)} fits no known layout for a [{out}, {inp}] weight")


def dequantize_weights(raw: dict[str, torch.Tensor], quant: Optional[dict[str, Any]]) -> int:
    """Replace every FP8 `*.weight` in `raw` by its dequantized float32 value and drop the scales
    that went with it (and the activation scales); GPTQ's and AWQ's packed weights likewise
    (backend/int_quantized.py). Returns how many weights were dequantized."""
    if quant and quant.get("quant_method") in INT_METHODS:
        return dequantize_int_weights(raw, quant)
    block = block_size(quant)
    count = 0
    for name in [n for n, t in raw.items() if n.endswith(".weight") and t.dtype in _FP8_DTYPES]:
        stem = name[: -len("weight")]
        scale = raw.pop(stem + "weight_scale", None)
        if scale is None:
            scale = raw.pop(stem + "weight_scale_inv", None)  # block-wise: multiplied in despite the name
        if scale is None:
            raise ValueError(f"FP8 weight '{name}' has no weight_scale")
        raw[name] = dequantize(raw[name], scale, block)
        count += 1
    for name in [n for n in raw if n.endswith((".input_scale", ".weight_scale", ".weight_scale_inv"))]:
        raw.pop(name)
    return count


def take_kv_scales(raw: dict[str, torch.Tensor], num_layers: int) -> Optional[list[tuple[float, float]]]:
    """Pop the per-layer K/V cache scales from `raw`: [(k_scale, v_scale)] per layer (1.0 where
    a layer has none), or None when the checkpoint has none at all."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    found = False
    for name in list(raw):
        for pattern, fixed in _KV_SCALE_NAMES:
            m = pattern.match(name)
            if m is None:
                continue
            layer = int(m.group(1))
            value = float(raw.pop(name).float().reshape(-1)[0])
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"KV cache scale '{name}' is {value}; scales must be positive and finite")
            if layer >= num_layers:
                raise ValueError(f"KV cache scale '{name}' names layer {layer}; the model has {num_layers}")
            for which in (fixed or m.group(2)):
                scales[layer]["kv".index(which)] = value
            found = True
            break
    return [(k, v) for k, v in scales] if found else None


# A fixed prefill for calculate_kv_scales: prose, code, numbers and markup, so the keys and values
# of the kinds of text a server sees are measured. Fixed, so the scales are reproducible.
CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March 2023, to review the quarterly results. Revenue rose 12.5%
to $4.2 billion, while operating costs fell by 3%. "We expect growth to continue," the chair said.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

{"id": 42, "name": "Ada Lovelace", "tags": ["math", "computing"], "active": true, "score": 9.75}

<table><tr><td>Paris</td><td>2,102,650</td></tr><tr><td>Tokyo</td><td>13,960,000</td></tr></table>
Q: What is the capital of Australia? A: Canberra, not Sydney, although Sydney is larger.
Once upon a time, in a village at the edge of a great forest, there lived an old woman who kept
bees. Every morning she walked to the river, filled two buckets, and carried them up the hill.
Die Sonne scheint, und les enfants jouent dans le parc. 東京は日本の首都です。Привет, мир!
"""

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a measured max|K| maps to 200 and max|V| to 100,
# well inside e4m3's 448, leaving room for inputs larger than the calibration's.
K_RANGE = 200.0
V_RANGE = 100.0


def measured_scales(maxima: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) from the measured (max|K|, max|V|); 1.0 where a layer's were
    all zero."""
    return [(k / K_RANGE if k > 0 else 1.0, v / V_RANGE if v > 0 else 1.0) for k, v in maxima]
