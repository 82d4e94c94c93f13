"""4-bit NormalFloat (NF4) weights, as QLoRA stores its frozen base (Dettmers et al., 2023).

A tensor is cut, flattened, into blocks of ``BLOCK`` values; each block keeps its absolute maximum
(float32) and every value the index (4 bits, two to a byte) of the nearest of the 16 NF4 levels
times that maximum. 0.5625 bytes a value instead of 2 (bf16): the frozen shards are stored, and
travel the broadcast / ring, in this form (``pack``), and are dequantized just before use. The
levels are bitsandbytes' ``nf4`` code; blocks are not double-quantized.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK = 64
LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def packed_bytes(shape: torch.Size) -> int:
    """Bytes of ``pack`` for a tensor of ``shape``: per block 4 (its maximum) + ``BLOCK / 2``."""
    blocks = math.ceil(shape.numel() / BLOCK)
    return blocks * (4 + BLOCK // 2)


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` quantized: one uint8 tensor ``[packed_bytes(w.shape)]``, the float32 block maxima
    first (so that they can be viewed as float32 in place), then the 4-bit codes."""
    flat = w.detach().float().reshape(-1)
    blocks = math.ceil(flat.numel() / BLOCK)
    flat = torch.nn.functional.pad(flat, (0, blocks * BLOCK - flat.numel())).view(blocks, BLOCK)
    absmax = flat.abs().amax(dim=1)
    scaled = flat / torch.where(absmax > 0, absmax, 1.0)[:, None]
    levels = torch.tensor(LEVELS, device=w.device)
    bounds = (levels[1:] + levels[:-1]) / 2  # nearest level: count the midpoints below
    codes = torch.bucketize(scaled, bounds).to(torch.uint8).view(-1, 2)
    nibbles = codes[:, 0] << 4 | codes[:, 1]
    return torch.cat([absmax.view(torch.uint8), nibbles])


def unpack(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` that ``packed`` (``pack``'s output) holds."""
    blocks = math.ceil(shape.numel() / BLOCK)
    absmax = packed[: 4 * blocks].view(torch.float32)
    # one 8-byte gather per code byte (its two levels), int32 indices: ~6x faster on CPU than
    # indexing a [256, 2] float table with int64 indices
    pairs = _byte_values(packed.device).index_select(0, packed[4 * blocks :].int())
    values = pairs.view(torch.float32).view(blocks, BLOCK).mul_(absmax[:, None])
    return values.view(-1)[: shape.numel()].view(shape).to(dtype)


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """``[256]`` int64: the two float32 levels each byte of codes stands for (high nibble
    first), side by side in 8 bytes. Made once per device: ``unpack`` runs for every shard a
    rank receives, and a fresh table would be a host-to-device copy each time."""
    levels = torch.tensor(LEVELS, device=device)
    pairs = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=1)
    return pairs.view(torch.int64).view(-1)


class ShardCodec:
    """How a schedule's shards travel: the NF4-packed ones (uint8, QLoRA's frozen base) as their
    bytes, dequantized to ``dtype`` on arrival; the others as they are."""

    def __init__(self, shards: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.packed = tuple(n for n, t in shards.items() if t.dtype == torch.uint8)
        self.dtype = dtype

    def on_wire(self, name: str, shape: torch.Size) -> torch.Size:
        """The size shard ``name`` of ``shape`` travels as."""
        return torch.Size([packed_bytes(shape)]) if name in self.packed else shape

    def arrived(self, w: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> None:
        """Dequantize, in ``w``, the packed shards just received (``shapes``: their own sizes)."""
        for n in self.packed:
            w[n] = unpack(w[n], shapes[n], self.dtype)


class StackedShard:
    """A ring buffer's form of one weight shard: tensors in ``groups``, each group one tensor
    stacked along dim 0 (e.g. ``[G; U]``, one GEMM), held as they are (views of the buffer) or,
    ``packed``, as NF4 bytes (QLoRA's frozen base) dequantized to ``dtype`` on arrival."""

    def __init__(self, packed: bool, dtype: torch.dtype) -> None:
        self.packed, self.dtype = packed, dtype

    def _numel(self, shape: torch.Size) -> int:
        return packed_bytes(shape) if self.packed else shape.numel()

    def numel(self, groups: list[list[tuple[int, ...]]]) -> int:
        """Buffer elements (bytes if packed) of a shard whose tensors have the shapes ``groups``."""
        return sum(self._numel(torch.Size(s)) for group in groups for s in group)

    def decode(self, buf: torch.Tensor, groups: list[list[tuple[int, ...]]]) -> list[torch.Tensor]:
        """One tensor per group from the buffer ``buf`` (views; dequantized copies if packed)."""
        out, i = [], 0
        for group in groups:
            shapes = [torch.Size(s) for s in group]
            if not self.packed:  # the group's tensors lie one after the other: one view
                n = sum(s.numel() for s in shapes)
                out.append(buf[i : i + n].view(sum(s[0] for s in shapes), *shapes[0][1:]))
                i += n
                continue
            parts = []
            for s in shapes:
                parts.append(unpack(buf[i : i + packed_bytes(s)], s, self.dtype))
                i += packed_bytes(s)
            out.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return out
