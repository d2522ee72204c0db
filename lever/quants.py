"""Per-format facts for every tensor type Lever computes with, in one table.

Like ggml's type traits: the loader checks tensors against it, the native kernels are
called with its ids, and the flash backend sizes reads from it. A type missing here is
unsupported, and the loader says so by name.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class TypeTraits:
    name: str
    ggml_id: int  # the GGUF on-disk type number, also enum lever_type in native/
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block
    activation: str  # what the matmul kernel quantizes activations to ("f32", "q8_0", "q8_K")

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_elems:
            raise ValueError(f"{self.name} rows need a multiple of {self.block_elems} elements, got {n_cols}")
        return n_cols // self.block_elems * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems


TYPES: dict[str, TypeTraits] = {
    t.name: t
    for t in (
        TypeTraits("F32", 0, 1, 4, "f32"),
        TypeTraits("F16", 1, 1, 2, "f32"),
        TypeTraits("BF16", 30, 1, 2, "f32"),
        TypeTraits("Q8_0", 8, 32, 34, "q8_0"),  # f16 d, 32 x int8
        TypeTraits("Q4_0", 2, 32, 18, "q8_0"),  # f16 d, 16 bytes of nibbles (x - 8)
        TypeTraits("Q5_0", 6, 32, 22, "q8_0"),  # f16 d, 4 bytes of 5th bits, 16 bytes of nibbles
        TypeTraits("Q4_K", 12, 256, 144, "q8_K"),  # f16 d, dmin, 12 bytes 6-bit scales/mins, 128 nibbles
        TypeTraits("Q6_K", 14, 256, 210, "q8_K"),  # 128 low nibbles, 64 high 2-bits, 16 int8 scales, f16 d
    )
}
BY_ID: dict[int, TypeTraits] = {t.ggml_id: t for t in TYPES.values()}


def traits(type_id: int) -> TypeTraits | None:
    return BY_ID.get(int(type_id))
