"""Per-format facts for every tensor type Lever computes with, in one table.

Like ggml's type traits: the loader checks tensors against it, the native kernels are
called with its ids, and the flash backend sizes reads from it. A type missing here is
unsupported, and the loader says so by name.
"""

from __future__ import annotations

import attrs

TILE_ROWS = 16  # rows per tile of the tile layout (LEVER_TILE_ROWS in native/lever_kernels.h)


@attrs.frozen
class TypeTraits:
    name: str
    ggml_id: int  # the GGUF on-disk type number, also enum lever_type in native/
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block
    activation: str  # what the matmul kernel quantizes activations to ("f32", "q8_0", "q8_K")
    # The tile layout's segments of a block, (offset, bytes, width): inside a tile, `width`
    # bytes of each of its TILE_ROWS rows side by side (2: an fp16 scale; 4: quants one 32-bit
    # SIMD lane holds), so byte `off` of a row's block lands at TILE_ROWS * off in the tile's.
    tile_segments: tuple[tuple[int, int, int], ...]

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_elems:
            raise ValueError(f"{self.name} rows need a multiple of {self.block_elems} elements, got {n_cols}")
        return n_cols // self.block_elems * self.block_bytes

    def tiled_bytes(self, n_rows: int, n_cols: int) -> int:
        """Bytes of an (n_rows, n_cols) matrix in the tile layout: whole tiles of TILE_ROWS rows."""
        return -(-n_rows // TILE_ROWS) * TILE_ROWS * self.row_bytes(n_cols)

TYPES: dict[str, TypeTraits] = {
    t.name: t
    for t in (
        TypeTraits("F32", 0, 1, 4, "f32", ((0, 4, 4),)),
        TypeTraits("F16", 1, 1, 2, "f32", ((0, 2, 2),)),
        TypeTraits("BF16", 30, 1, 2, "f32", ((0, 2, 2),)),
        TypeTraits("Q8_0", 8, 32, 34, "q8_0", ((0, 2, 2), (2, 32, 4))),  # f16 d, 32 x int8
        TypeTraits("Q4_0", 2, 32, 18, "q8_0", ((0, 2, 2), (2, 16, 4))),  # f16 d, 16 bytes of nibbles (x - 8)
        TypeTraits("Q5_0", 6, 32, 22, "q8_0", ((0, 2, 2), (2, 20, 4))),  # f16 d, 4 bytes of 5th bits, 16 of nibbles
        # f16 d, dmin, 12 bytes 6-bit scales/mins, 128 nibbles (d | dmin one 32-bit group)
        TypeTraits("Q4_K", 12, 256, 144, "q8_K", ((0, 144, 4),)),
        # 128 low nibbles, 64 high 2-bits, 16 int8 scales, f16 d
        TypeTraits("Q6_K", 14, 256, 210, "q8_K", ((0, 208, 4), (208, 2, 2))),
    )
}
BY_ID: dict[int, TypeTraits] = {t.ggml_id: t for t in TYPES.values()}


def traits(type_id: int) -> TypeTraits | None:
    return BY_ID.get(int(type_id))
