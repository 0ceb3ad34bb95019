"""The formats a LocalSGD sync's deltas travel in (``sync_dtype``): rows of values to bytes and back.

A sync sums the deltas in chunks, one per rank (``lit_dp.local_sgd.transport``): each chunk is a
row that a format encodes into bytes, sent with one ``all_to_all``, decoded and summed in fp32 by
the rank that owns it, encoded again and sent back with one ``all_gather``. Every format is pure
torch on the values' device (no Triton, CPU and CUDA alike) and sends bytes (``torch.uint8``), so
any backend with those two collectives carries every format.

- ``bf16``: each value cast to bfloat16: 2 bytes a value.
- ``int8``, ``int4``, ``fp8`` (``float8_e4m3fn``, where the torch build has it): each block of
  ``BLOCK`` consecutive values of a row shares one fp32 scale, the block's largest magnitude over
  the code's (127, 7, 448); a value travels as the code nearest ``value / scale`` (round half to
  even; fp8's own rounding), two int4 codes a byte. An encoded row is its blocks' scales, then
  their codes, so the scales travel in the same message and are counted in the bytes:
  ``1 + 4/BLOCK`` bytes a value for int8 and fp8, ``1/2 + 4/BLOCK`` for int4.

A value the format represents (its block's scale times a code) comes back exactly, and so does a
sum of such values that the format represents: the sums are taken in fp32 (fp64 for fp64
parameters), never in the low precision. What a format drops is ``values - decode(encode(values))``,
which error feedback carries into the next sync (``SyncBucket``).
"""

from __future__ import annotations

from typing import Any

import torch

from lit_dp.options.local_sgd import SYNC_DTYPES, default_error_feedback

# Values per fp32 scale. 128 keeps the scales' share of the bytes at 1/32 of a value's byte and under
# the bytes asked of each format (int8 at most 0.27 of fp32's, int4 at most 0.14: issue 53), where
# 64 would put int4 at 0.141; smaller blocks follow outliers more closely, larger ones cost fewer scales.
BLOCK = 128
_SCALE = torch.float32


class WireFormat:
    """Rows of values (``[rows, length]``, ``length`` a multiple of ``granule``) to rows of bytes and back."""

    name: str
    bits: int  # per value on the wire, scales aside
    granule: int  # a row's length is a multiple of it

    def row_bytes(self, length: int) -> int:
        """The bytes of one encoded row of ``length`` values."""
        raise NotImplementedError

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, length]`` floats to ``[rows, row_bytes(length)]`` bytes."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, row_bytes(length)]`` bytes to ``[rows, length]`` values in ``dtype``."""
        raise NotImplementedError

    def carries(self, dtype: torch.dtype) -> bool:
        """Whether values of ``dtype`` travel unchanged (nothing to encode)."""
        return False


class Cast(WireFormat):
    """Each value cast to ``dtype`` (bf16)."""

    granule = 1

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype, self.bits = name, dtype, dtype.itemsize * 8

    def row_bytes(self, length: int) -> int:
        return length * self.dtype.itemsize

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.dtype).view(torch.uint8)

    def decode(self, data: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        return data.view(self.dtype).to(dtype)

    def carries(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype


class BlockScaled(WireFormat):
    """Blocks of ``BLOCK`` values, each with its fp32 scale (largest magnitude / ``largest`` code) and its codes."""

    granule = BLOCK
    largest: float

    def row_bytes(self, length: int) -> int:
        blocks = length // BLOCK
        return blocks * _SCALE.itemsize + blocks * BLOCK * self.bits // 8

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        count, length = rows.shape
        blocks = rows.reshape(count, length // BLOCK, BLOCK)
        # The scale is rounded to fp32 first, and the codes are taken against that rounded scale, which
        # is the one decode multiplies by. A block of zeros has scale 0 and codes 0; a non-finite value
        # makes its block's scale non-finite, and decode gives the block back non-finite, as an fp32 sync would.
        scales = (blocks.abs().amax(dim=-1) / self.largest).to(_SCALE)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(rows.dtype)
        scaled = (blocks / divisor.unsqueeze(-1)).clamp_(-self.largest, self.largest)
        codes = self._codes(scaled).reshape(count, -1)
        return torch.cat([scales.view(torch.uint8), codes], dim=1)

    def decode(self, data: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        count, blocks = data.shape[0], length // BLOCK
        scales = data[:, : blocks * _SCALE.itemsize].contiguous().view(_SCALE).to(dtype)
        codes = data[:, blocks * _SCALE.itemsize :].reshape(count, blocks, -1)
        return (self._values(codes, dtype) * scales.unsqueeze(-1)).reshape(count, length)

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """``[..., BLOCK]`` values within ``±largest`` to ``[..., BLOCK * bits / 8]`` bytes."""
        raise NotImplementedError

    def _values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of ``_codes``: ``[..., BLOCK]`` code values in ``dtype``."""
        raise NotImplementedError


class Int8(BlockScaled):
    name, bits, largest = "int8", 8, 127.0

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().to(torch.int8).view(torch.uint8)

    def _values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return codes.view(torch.int8).to(dtype)


class Int4(BlockScaled):
    """Codes -7..7, stored with an offset of 8 in a nibble: the even value of a pair in the low one."""

    name, bits, largest = "int4", 4, 7.0

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        nibbles = (scaled.round().to(torch.int16) + 8).to(torch.uint8)
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)

    def _values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], BLOCK)
        return nibbles.to(dtype) - 8


class Float8(BlockScaled):
    """``float8_e4m3fn`` codes (its largest finite value is 448)."""

    name, bits, largest = "fp8", 8, 448.0

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(self.dtype).view(torch.uint8)

    def _values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return codes.view(self.dtype).to(dtype)


def available_formats() -> dict[str, WireFormat]:
    """The formats this torch build can encode, by ``sync_dtype`` name."""
    formats: list[WireFormat] = [Cast("bf16", torch.bfloat16), Int8(), Int4()]
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        formats.append(Float8(fp8))
    return {f.name: f for f in formats}


def wire_format(value: Any) -> WireFormat | None:
    """None, a name in ``SYNC_DTYPES`` ("bf16", "int8", "int4", "fp8"), or ``torch.bfloat16``."""
    formats = available_formats()
    if value is None:
        return None
    if value == torch.bfloat16:
        return formats["bf16"]
    if isinstance(value, str) and value in formats:
        return formats[value]
    names = ", ".join(repr(name) for name in SYNC_DTYPES if name in formats)
    missing = [name for name in SYNC_DTYPES if name not in formats]
    build = f" (this torch build, {torch.__version__}, has no float8_e4m3fn for {missing[0]!r})" if value in missing else ""
    raise ValueError(f"sync_dtype={value!r} is invalid{build}: expected None, torch.bfloat16 or one of {names}.")


def resolve_error_feedback(value: Any, wire: WireFormat | None) -> bool:
    """``error_feedback`` as given, or its default for ``wire`` (``default_error_feedback``); refused with no
    format, which drops nothing."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"error_feedback={value!r} is invalid: expected True, False or None (on for 8 bits and below).")
    if wire is None:
        if value:
            raise ValueError(
                "error_feedback=True with sync_dtype=None is invalid: a sync in the parameters' dtype drops nothing "
                "to feed back; expected a sync_dtype (bf16, int8, int4, fp8) or error_feedback=None."
            )
        return False
    return default_error_feedback(wire.bits) if value is None else value
