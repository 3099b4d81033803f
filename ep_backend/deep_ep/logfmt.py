"""LogFMT-10, DeepEP's optional compression of low-latency combine payloads (``use_logfmt``).

Each row is cut into groups of 64 channels. A group whose magnitudes all lie below 1 (and are
not all equal) is coded in 10 bits per value: a sign bit and a 9-bit code, where code 0 means
zero and codes 1..511 stand for 511 magnitudes spaced evenly in log2 between the group's smallest
non-zero magnitude (clipped to at most 2^32 below the largest) and its largest. A magnitude goes
to the nearest of those levels in linear terms (or to zero, when nearer to zero than to the
lowest level). Other groups travel as BF16 unchanged.

``ep`` has no LogFMT wire format, so the facade applies the same rounding to the expert outputs
before the combine (``encode_decode``): the combined values are those of a LogFMT combine, the
bytes sent are BF16's.
"""

from __future__ import annotations

import torch

__all__ = ["GROUP_SIZE", "NUM_LEVELS", "encode_decode"]

GROUP_SIZE = 64
NUM_LEVELS = 511  # codes 1..511; code 0 is zero (2^9 codes of the 9 magnitude bits)
MAX_LOG_RANGE = 32.0


def encode_decode(x: torch.Tensor) -> torch.Tensor:
    """BF16 ``x`` (last dim a multiple of 64) after a LogFMT-10 round trip, same shape and dtype.

    Raises:
        ValueError: for another dtype or a last dimension not a multiple of 64.
    """
    if x.dtype != torch.bfloat16:
        raise ValueError(f"LogFMT combine needs BF16 expert outputs, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"LogFMT needs a hidden size that is a multiple of {GROUP_SIZE}")
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    magnitude = groups.abs()
    amax = magnitude.amax(dim=-1, keepdim=True)
    nonzero_min = torch.where(magnitude > 0, magnitude, torch.full_like(magnitude, torch.inf))
    amin = nonzero_min.amin(dim=-1, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - MAX_LOG_RANGE)
    coded = (log_amax < 0) & (log_amin < log_amax)  # per group; else BF16 as is

    step = torch.where(coded, (log_amax - log_amin) / (NUM_LEVELS - 1), torch.ones_like(amax))
    base = torch.where(coded, log_amin, torch.zeros_like(amax))
    position = (torch.log2(magnitude) - base) / step
    low = position.floor().clamp(0, NUM_LEVELS - 1)
    high = (low + 1).clamp(max=NUM_LEVELS - 1)
    low_value = torch.exp2(base + low * step)
    high_value = torch.exp2(base + high * step)
    level_value = torch.where(magnitude * 2 >= low_value + high_value, high_value, low_value)
    lowest = torch.exp2(base)
    level_value = torch.where(magnitude * 2 < lowest, torch.zeros_like(level_value), level_value)
    decoded = torch.copysign(level_value, groups)
    out = torch.where(coded, decoded, groups)
    return out.reshape(x.shape).to(torch.bfloat16)
