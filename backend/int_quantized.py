"""GPTQ and AWQ checkpoints: their packed integer weights in the model's dtype.

Both store each linear as integers packed eight (4-bit) to an int32, with a scale and a zero point
per group of `group_size` input rows and output column. The runner has no integer matmuls, so a
weight is multiplied out once, at load, as (q - zero) * scale: the checkpoint loads and runs with
the numbers it was quantized to, at the memory of an unquantized model (as the FP8 exports do,
backend/quantized_checkpoint.py).

The layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them and vLLM reads them:

* GPTQ: `qweight` [in / pack, out], input rows packed, row j of a word in bits bits*j..;
  `qzeros` [groups, out / pack], output columns packed the same way; `scales` [groups, out];
  `g_idx` [in] (each input row's group: act-order checkpoints permute them), else row // group.
  The "gptq" checkpoint format stores zero - 1 (the v1 quirk), "gptq_v2" the zero itself.
* AWQ (GEMM): `qweight` [in, out / 8] and `qzeros` [groups, out / 8], output columns packed in
  AutoAWQ's interleaved order (nibble i holds column ORDER[i] of its eight); `scales` [groups, out].
"""

from __future__ import annotations

from typing import Any, Optional

import torch

INT_METHODS = ("gptq", "awq")
GPTQ_BITS = (2, 4, 8)
# AutoAWQ packs the columns 8k..8k+7 of a word as nibbles i = 0..7 holding column 8k + ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def check_int_quantization(quant: dict[str, Any]) -> None:
    method = quant.get("quant_method")
    bits = quant.get("bits", quant.get("w_bit"))
    if method == "gptq":
        if bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ with {bits} bits is not supported (bits: {', '.join(map(str, GPTQ_BITS))})")
        if quant.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format '{quant['checkpoint_format']}' is not supported "
                             "(gptq, gptq_v2)")
    elif method == "awq":
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not supported (4)")
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version '{version}' is not supported (gemm)")
        if not quant.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The integers packed `32 // bits` to an int32 along `dim`, the lowest bits first."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * words.dim()
    shape[dim + 1] = per_word
    values = (words >> shifts.view(shape)) & ((1 << bits) - 1)
    return values.flatten(dim, dim + 1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                    bits: int, group_size: int, v2: bool = False) -> torch.Tensor:
    """A GPTQ linear's weight [out, in] in float32."""
    q = _unpack(qweight, bits, 0)  # [in, out]
    zeros = _unpack(qzeros, bits, 1)[:, : q.shape[1]]  # [groups, out]
    if not v2:
        zeros = zeros + 1
    rows = q.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(rows) // (group_size if group_size > 0 else rows)
    w = (q - zeros[groups]).float() * scales.float()[groups]
    return w.t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """An AWQ (GEMM) linear's weight [out, in] in float32."""
    reorder = torch.tensor(AWQ_ORDER).argsort()  # column c of a word is nibble reorder[c]

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack(packed, 4, 1).view(packed.shape[0], -1, 8)
        return nibbles[:, :, reorder].flatten(1)

    q, zeros = unpack(qweight), unpack(qzeros)  # [in, out], [groups, out]
    rows = q.shape[0]
    groups = torch.arange(rows) // (group_size if group_size > 0 else rows)
    w = (q - zeros[groups]).float() * scales.float()[groups]
    return w.t().contiguous()


def dequantize_int_weights(raw: dict[str, torch.Tensor], quant: dict[str, Any]) -> int:
    """Replace every packed linear in `raw` (`*.qweight` with its `qzeros`, `scales` and GPTQ's
    `g_idx`) by its float32 `*.weight`. Returns how many were dequantized."""
    method = quant["quant_method"]
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
    count = 0
    for name in [n for n in raw if n.endswith(".qweight")]:
        stem = name[: -len("qweight")]
        try:
            qzeros, scales = raw.pop(stem + "qzeros"), raw.pop(stem + "scales")
        except KeyError:
            raise ValueError(f"{method.upper()} weight '{name}' lacks its qzeros or scales") from None
        qweight = raw.pop(name)
        if method == "gptq":
            weight = dequantize_gptq(qweight, qzeros, scales, raw.pop(stem + "g_idx", None), bits, group_size,
                                     v2=quant.get("checkpoint_format") == "gptq_v2")
        else:
            weight = dequantize_awq(qweight, qzeros, scales, group_size)
        raw[stem + "weight"] = weight
        count += 1
    return count
