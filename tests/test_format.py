"""Storage format: sizes, validation, pack/unpack (numpy and jnp), FORMAT.md test vectors."""
from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tq import format as tq_format

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
FORMAT_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"

# Also hard-coded here so an edit of FORMAT.md cannot silently change the format.
EXPECTED_VECTORS = [
    (2, [0, 1, 2, 3, 3, 2, 1, 0], [0xE4, 0x1B]),
    (2, [3, 0, 0, 1, 2, 0, 0, 3], [0x43, 0xC2]),
    (3, [0, 1, 2, 3, 4, 5, 6, 7], [0x88, 0xC6, 0xFA]),
    (3, [0, 0, 7, 0, 0, 7, 0, 0], [0xC0, 0x81, 0x03]),
    (3, [5, 3, 6, 1, 7, 2, 4, 0], [0x9D, 0x73, 0x11]),
    (4, [1, 2, 3, 4, 5, 6, 7, 15], [0x21, 0x43, 0x65, 0xF7]),
    (4, [10, 5, 0, 15, 12, 3, 9, 6], [0x5A, 0xF0, 0x3C, 0x69]),
]


def bitstream_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent oracle: LSB-first bit stream via np.packbits."""
    shifts = np.arange(bits)
    code_bits = (codes[..., None].astype(np.int64) >> shifts) & 1        # [..., d, bits]
    flat = code_bits.reshape(codes.shape[:-1] + (-1,)).astype(np.uint8)
    return np.packbits(flat, axis=-1, bitorder="little")


def bitstream_unpack(packed: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """Independent oracle: inverse of bitstream_pack via np.unpackbits."""
    flat = np.unpackbits(packed, axis=-1, bitorder="little").astype(np.int64)
    code_bits = flat.reshape(packed.shape[:-1] + (head_dim, bits))
    return np.sum(code_bits << np.arange(bits), axis=-1).astype(np.uint8)


def parse_format_md_vectors():
    """Rows '| bits | codes | hex bytes |' of the FORMAT.md test-vector table."""
    pattern = re.compile(r"^\|\s*([234])\s*\|\s*([\d ]+?)\s*\|\s*([0-9a-f ]+?)\s*\|\s*$")
    vectors = []
    for line in FORMAT_MD.read_text().splitlines():
        match = pattern.match(line)
        if match:
            bits = int(match.group(1))
            codes = [int(token) for token in match.group(2).split()]
            packed = [int(token, 16) for token in match.group(3).split()]
            vectors.append((bits, codes, packed))
    return vectors


# ---------------------------------------------------------------------------------------------
# sizes and validation
# ---------------------------------------------------------------------------------------------
def test_constants():
    assert tq_format.SUPPORTED_HEAD_DIMS == HEAD_DIMS
    assert tq_format.PACKED_BITS == (2, 3, 4)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_bytes(head_dim, bits):
    assert tq_format.packed_bytes(head_dim, bits) == head_dim * bits // 8


def test_packed_bytes_examples():
    assert tq_format.packed_bytes(128, 4) == 64
    assert tq_format.packed_bytes(128, 3) == 48
    assert tq_format.packed_bytes(80, 3) == 30
    assert tq_format.packed_bytes(64, 2) == 16


@pytest.mark.parametrize("bad", [0, 1, 5, 8])
def test_check_bits_rejects(bad):
    with pytest.raises(ValueError, match="bits"):
        tq_format.check_bits(bad)
    with pytest.raises(ValueError, match="bits"):
        tq_format.packed_bytes(128, bad)


@pytest.mark.parametrize("bad", [0, 32, 100, 112, 512])
def test_check_head_dim_rejects(bad):
    with pytest.raises(ValueError, match="head_dim"):
        tq_format.check_head_dim(bad)


def test_check_types():
    with pytest.raises(TypeError, match="bits"):
        tq_format.check_bits(2.0)
    with pytest.raises(TypeError, match="bits"):
        tq_format.check_bits(True)
    with pytest.raises(TypeError, match="head_dim"):
        tq_format.check_head_dim("128")
    assert tq_format.check_head_dim(np.int32(96)) == 96


def test_cache_shapes():
    assert tq_format.cache_codes_shape(10, 4, 16, 128, 3) == (10, 4, 16, 48)
    assert tq_format.cache_norms_shape(10, 4, 16) == (10, 4, 16)
    with pytest.raises(ValueError, match="page_size"):
        tq_format.cache_codes_shape(10, 4, 0, 128, 3)
    with pytest.raises(TypeError, match="num_pages"):
        tq_format.cache_norms_shape(10.0, 4, 16)
    with pytest.raises(ValueError, match="bits"):
        tq_format.cache_codes_shape(10, 4, 16, 128, 1)


# ---------------------------------------------------------------------------------------------
# test vectors
# ---------------------------------------------------------------------------------------------
def test_format_md_vectors_match_expected():
    assert parse_format_md_vectors() == EXPECTED_VECTORS


@pytest.mark.parametrize("bits,codes,packed", EXPECTED_VECTORS)
def test_vectors_byte_for_byte(bits, codes, packed):
    group = np.array(codes, dtype=np.uint8)
    full = np.tile(group, 8)                          # head_dim 64
    expected = np.tile(np.array(packed, dtype=np.uint8), 8)
    np.testing.assert_array_equal(tq_format.pack_codes(full, bits), expected)
    np.testing.assert_array_equal(np.asarray(tq_format.pack_codes(jnp.asarray(full), bits)),
                                  expected)
    np.testing.assert_array_equal(bitstream_pack(full, bits), expected)
    np.testing.assert_array_equal(tq_format.unpack_codes(expected, bits, 64), full)


def test_vector_in_middle_of_row():
    """A group's bytes land at offset g*bits: put one vector in group 5 of zeros."""
    codes = np.zeros(128, dtype=np.uint8)
    codes[40:48] = [5, 3, 6, 1, 7, 2, 4, 0]
    packed = tq_format.pack_codes(codes, 3)
    assert list(np.nonzero(packed)[0]) == [15, 16, 17]
    np.testing.assert_array_equal(packed[15:18], [0x9D, 0x73, 0x11])


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_roundtrip_numpy_jnp_oracle(head_dim, bits):
    rng = np.random.default_rng(1000 * bits + head_dim)
    codes = rng.integers(0, 2 ** bits, size=(3, 5, head_dim), dtype=np.uint8)
    packed = tq_format.pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, head_dim * bits // 8)
    np.testing.assert_array_equal(packed, bitstream_pack(codes, bits))
    packed_jnp = jax.jit(lambda c: tq_format.pack_codes(c, bits))(jnp.asarray(codes))
    assert packed_jnp.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed_jnp), packed)
    unpacked = tq_format.unpack_codes(packed, bits, head_dim)
    assert unpacked.dtype == np.uint8
    np.testing.assert_array_equal(unpacked, codes)
    unpacked_jnp = jax.jit(lambda p: tq_format.unpack_codes(p, bits, head_dim))(packed_jnp)
    np.testing.assert_array_equal(np.asarray(unpacked_jnp), codes)
    random_bytes = rng.integers(0, 256, size=(4, head_dim * bits // 8), dtype=np.uint8)
    np.testing.assert_array_equal(tq_format.unpack_codes(random_bytes, bits, head_dim),
                                  bitstream_unpack(random_bytes, bits, head_dim))


def test_pack_accepts_wider_int_dtypes():
    codes = np.arange(128, dtype=np.int32) % 16
    np.testing.assert_array_equal(tq_format.pack_codes(codes, 4),
                                  tq_format.pack_codes(codes.astype(np.uint8), 4))


@pytest.mark.parametrize("bits", [2, 4])
def test_all_byte_values_roundtrip(bits):
    all_bytes = np.arange(256, dtype=np.uint8).repeat(64 * bits // 8).reshape(256, -1)
    codes = tq_format.unpack_codes(all_bytes, bits, 64)
    np.testing.assert_array_equal(tq_format.pack_codes(codes, bits), all_bytes)
    np.testing.assert_array_equal(codes, bitstream_unpack(all_bytes, bits, 64))


def _all_three_byte_groups(chunk: int, num_chunks: int):
    """Chunk ``chunk`` of all 2**24 group words: (bytes uint8 [n, 3], codes uint8 [n, 8])."""
    per_chunk = (1 << 24) // num_chunks
    words = np.arange(chunk * per_chunk, (chunk + 1) * per_chunk, dtype=np.uint32)
    group_bytes = words.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3]  # little endian
    group_codes = np.empty((words.size, 8), np.uint8)
    for k in range(8):  # independent of jax_tq.format: code k is bits [3k, 3k+3) of the word
        group_codes[:, k] = (words >> np.uint32(3 * k)) & 7
    return group_bytes, group_codes


@pytest.mark.slow
def test_three_bit_exhaustive():
    """All 2**24 states of a 3-byte group, both directions (16 groups per 128-dim row)."""
    num_chunks = 4
    for chunk in range(num_chunks):
        group_bytes, group_codes = _all_three_byte_groups(chunk, num_chunks)
        packed_rows = group_bytes.reshape(-1, 48)
        code_rows = group_codes.reshape(-1, 128)
        np.testing.assert_array_equal(tq_format.unpack_codes(packed_rows, 3, 128), code_rows)
        np.testing.assert_array_equal(tq_format.pack_codes(code_rows, 3), packed_rows)


def test_three_bit_jnp_sample_of_exhaustive():
    group_bytes, group_codes = _all_three_byte_groups(5, 64)
    packed_rows = jnp.asarray(group_bytes.reshape(-1, 48))
    unpacked = jax.jit(lambda p: tq_format.unpack_codes(p, 3, 128))(packed_rows)
    np.testing.assert_array_equal(np.asarray(unpacked), group_codes.reshape(-1, 128))
    repacked = jax.jit(lambda c: tq_format.pack_codes(c, 3))(unpacked)
    np.testing.assert_array_equal(np.asarray(repacked), np.asarray(packed_rows))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_pack_errors():
    with pytest.raises(ValueError, match="codes"):
        tq_format.pack_codes(np.full(64, 4, np.uint8), 2)
    with pytest.raises(ValueError, match="codes"):
        tq_format.pack_codes(np.full(64, -1, np.int8), 2)
    with pytest.raises(TypeError, match="codes"):
        tq_format.pack_codes(np.zeros(64, np.float32), 2)
    with pytest.raises(ValueError, match="codes.shape"):
        tq_format.pack_codes(np.zeros(72, np.uint8), 2)
    with pytest.raises(ValueError, match="bits"):
        tq_format.pack_codes(np.zeros(64, np.uint8), 1)


def test_unpack_errors():
    with pytest.raises(ValueError, match="packed.shape"):
        tq_format.unpack_codes(np.zeros(47, np.uint8), 3, 128)
    with pytest.raises(TypeError, match="uint8"):
        tq_format.unpack_codes(np.zeros(48, np.int32), 3, 128)
    with pytest.raises(ValueError, match="head_dim"):
        tq_format.unpack_codes(np.zeros(48, np.uint8), 3, 100)


def test_hadamard_spec_test_vector_and_codec_rows():
    """The docs/FORMAT.md test vector, and every power-of-two Hadamard codec's spec words rebuild
    its rotation matrix exactly (Pi = H D2 P H D1)."""
    from jax_tq import rotation
    words = tq_format.hadamard_spec([1, -1, 1, 1], [2, 0, 3, 1], [-1, 1, 1, -1])
    assert words.dtype == np.int32 and words.tolist() == [131074, 65536, 3, 131073]

    def rebuild(words):
        d = words.shape[0]
        first = np.where(words & tq_format.ROT_NEG1_BIT, -1.0, 1.0)
        second = np.where(words & tq_format.ROT_NEG2_BIT, -1.0, 1.0)
        h = rotation.block_hadamard(d)
        return h @ (second[:, None] * (h * first[None, :])[words & 0xFFFF, :])

    np.testing.assert_allclose(rebuild(words) @ np.arange(1.0, 5.0), [4.0, 2.0, 3.0, -1.0], atol=1e-12)
    import jax_tq as tq
    for head_dim, seed in ((64, 0), (128, 7), (256, 3)):
        codec = tq.TurboQuant(head_dim=head_dim, bits=4, seed=seed, rotation="hadamard")
        np.testing.assert_allclose(rebuild(codec.hadamard_spec), rotation.hadamard_rotation(head_dim, seed), atol=1e-12)
    assert tq.TurboQuant(head_dim=80, rotation="hadamard").hadamard_spec is None  # block-diagonal
    assert tq.TurboQuant(head_dim=128).hadamard_spec is None  # haar


@pytest.mark.parametrize("args,match", [
    (([1, 1, 1], [0, 1, 2], [1, 1, 1]), "power of two"),
    (([1, 1], [0, 0], [1, 1]), "not a permutation"),
    (([1, 2], [0, 1], [1, 1]), "signs"),
    (([1, 1, 1, 1], [0, 1], [1, 1]), "signs must be"),
])
def test_hadamard_spec_errors(args, match):
    with pytest.raises(ValueError, match=match):
        tq_format.hadamard_spec(*args)


# ---------------------------------------------------------------------------------------------
# QJL sign bits
# ---------------------------------------------------------------------------------------------
EXPECTED_SIGN_VECTORS = [("+ - - - - - - -", 0x01), ("- - - - - - - +", 0x80), ("+ + - + - - + +", 0xCB),
                         ("- + - + - + - +", 0xAA)]


def parse_format_md_sign_vectors():
    """Rows '| + - ... | hex byte |' of FORMAT.md's sign-bit table."""
    pattern = re.compile(r"^\|\s*([+\- ]{15})\s*\|\s*([0-9a-f]{2})\s*\|\s*$")
    return [(m.group(1), int(m.group(2), 16)) for m in map(pattern.match, FORMAT_MD.read_text().splitlines()) if m]


def test_format_md_sign_vectors_match_expected():
    assert parse_format_md_sign_vectors() == EXPECTED_SIGN_VECTORS


@pytest.mark.parametrize("signs,byte", EXPECTED_SIGN_VECTORS)
def test_sign_vectors_byte_for_byte(signs, byte):
    group = np.array([s == "+" for s in signs.split()])
    full = np.tile(group, 16)                          # head_dim 128
    expected = np.full(16, byte, np.uint8)
    np.testing.assert_array_equal(tq_format.pack_signs(full), expected)
    np.testing.assert_array_equal(np.asarray(tq_format.pack_signs(jnp.asarray(full))), expected)
    np.testing.assert_array_equal(np.packbits(full.astype(np.uint8), bitorder="little"), expected)
    np.testing.assert_array_equal(tq_format.unpack_signs(expected, 128), np.where(full, 1, -1))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_signs_round_trip_and_validation(rng, head_dim):
    positive = rng.integers(0, 2, size=(3, head_dim)).astype(bool)
    packed = tq_format.pack_signs(positive)
    assert packed.shape == (3, tq_format.sign_bytes(head_dim)) and packed.dtype == np.uint8
    np.testing.assert_array_equal(tq_format.unpack_signs(packed, head_dim), np.where(positive, 1, -1))
    with pytest.raises(ValueError, match="head_dim"):
        tq_format.unpack_signs(packed[:, :-1], head_dim)
    with pytest.raises(TypeError, match="uint8"):
        tq_format.unpack_signs(packed.astype(np.int32), head_dim)


def test_the_cpp_tables_match_the_python_ones():
    """format.h's SupportedHeadDims / PackedBits (what the kernels instantiate) are format.py's tables."""
    header = (pathlib.Path(__file__).parent.parent / "cuda_ops/include/jax_tq/format.h").read_text()
    for name, table in (("SupportedHeadDims", tq_format.SUPPORTED_HEAD_DIMS), ("PackedBits", tq_format.PACKED_BITS)):
        found = re.search(rf"using {name} = IntList<([0-9, ]+)>;", header)
        assert found, name
        assert tuple(int(v) for v in found.group(1).split(",")) == tuple(table), name
