"""CRC-32C (Castagnoli): the `crc32c` package when it is installed, else a numpy fallback.

TFRecord framing and checkpoint manifests both checksum with CRC-32C. A machine without the
`crc32c` package (an offline GPU machine, say) still reads, verifies and writes both through the
fallback here, which gives the same values, only slower; the first fallback call prints one note
saying so.

The module is not named ``crc32c``: run as ``python utils/x.py``, a script would put ``utils/`` on
``sys.path`` and such a module would shadow the package.

How the fallback is fast without C: a CRC register is linear over GF(2), and feeding zero bytes
into a zero register leaves it zero. So the data, zero-padded at the front to whole blocks, is cut
into equal blocks; numpy runs all blocks' registers side by side (8 bytes a step, through tables
indexed by 16 bits), then folds each run of 64 neighbouring registers into one: each is advanced
over the blocks after it in the run (a linear map on 32 bits, applied through 4 byte tables) and
the run XORed together, until one register is left. A starting register is XORed into the first
four data bytes, which for this reflected CRC is the same as starting from it.

Measured on a shared 2-core x86-64 machine (numpy 2.4; the spread is that machine's load): a
4 KB TFRecord record 45-85 us (50-110 MB/s, about what decoding the record takes), large files
(checkpoints) 0.3-1.1 GB/s; the package did 10-30 GB/s. Inputs under 512 bytes (TFRecord length
headers) take a plain Python loop, 1.5-3 us for 8 bytes.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

try:
    import crc32c as _package
except ImportError:
    _package = None

USING_PACKAGE = _package is not None
"""True when the `crc32c` package computes the checksums."""

FALLBACK_NOTE = (
    "note: the crc32c package is not installed, so CRC-32C checksums (TFRecords, checkpoints) run "
    "in numpy, tens to hundreds of times slower: pip install crc32c (offline: the wheel that "
    "benchmarks/prepare_gpu_wheels.sh downloads)"
)

_POLYNOMIAL = 0x82F63B78  # Castagnoli's polynomial, bit-reversed (the CRC is reflected)
_MASK32 = 0xFFFFFFFF
# Bytes per block that numpy runs side by side, short ones for inputs below _LONG_BLOCKS_FROM.
_SHORT_BLOCK, _LONG_BLOCK, _LONG_BLOCKS_FROM = 16, 64, 1 << 16
_FOLD = 64  # block registers folded into one at a time
_SMALL_INPUT = 512  # below this many bytes a plain Python loop beats numpy's per-call overhead
_PIECE_BYTES = 1 << 20  # larger inputs go a piece at a time, so the working arrays stay in cache
_note_printed = False


def crc32c(data, value: int = 0) -> int:
    """The CRC-32C of `data`, continuing from the CRC `value` of the bytes before it.

    Same as ``crc32c.crc32c(data, value)`` of the package: ``crc32c(b + c) == crc32c(c,
    crc32c(b))``.

    Args:
        data: a bytes-like object (bytes, bytearray, memoryview, contiguous numpy array).
        value: the CRC of what came before `data`; 0 to start.

    Returns:
        The checksum as an unsigned 32-bit integer.
    """
    if _package is not None:
        return _package.crc32c(data, value)
    _print_note_once()
    return crc32c_fallback(data, value)


def _print_note_once() -> None:
    global _note_printed
    if not _note_printed:
        _note_printed = True
        print(FALLBACK_NOTE, file=sys.stderr, flush=True)


def crc32c_fallback(data, value: int = 0) -> int:
    """`crc32c` without the package (what `crc32c` runs when the package is missing)."""
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    register = (value & _MASK32) ^ _MASK32
    for start in range(0, len(raw), _PIECE_BYTES):
        register = _advance(register, raw[start : start + _PIECE_BYTES])
    return register ^ _MASK32


def _advance(register: int, raw: np.ndarray) -> int:
    """The register after feeding it `raw` (no inversion at either end)."""
    if len(raw) < _SMALL_INPUT:
        table = _byte_table_list()
        for byte in raw.tobytes():
            register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
        return register
    # Short blocks cut the steps of small inputs; long ones the folding work of large inputs.
    block_bytes = _SHORT_BLOCK if len(raw) < _LONG_BLOCKS_FROM else _LONG_BLOCK
    num_blocks = -(-len(raw) // block_bytes)
    padded = np.zeros(num_blocks * block_bytes, dtype=np.uint8)
    padding = len(padded) - len(raw)
    padded[padding:] = raw
    padded[padding : padding + 4] ^= np.frombuffer(register.to_bytes(4, "little"), np.uint8)
    # Word j of every block, contiguous, so each step reads one plain array.
    words = padded.view("<u4").reshape(num_blocks, block_bytes // 4).T.copy()
    low8, high8, low4, high4 = _step_tables()
    registers = np.zeros(num_blocks, dtype=np.uint32)
    mixed = np.empty_like(registers)
    for j in range(0, block_bytes // 4, 2):
        np.bitwise_xor(registers, words[j], out=mixed)
        following = words[j + 1]
        registers = low8[mixed & 0xFFFF]
        registers ^= high8[mixed >> 16]
        registers ^= low4[following & 0xFFFF]
        registers ^= high4[following >> 16]
    span = block_bytes
    while len(registers) > 1:
        registers = _fold(registers, span)
        span *= _FOLD
    return int(registers[0])


def _fold(registers: np.ndarray, span: int) -> np.ndarray:
    """Each run of `_FOLD` neighbouring block registers (blocks of `span` bytes) made one register.

    Register j of a run is advanced over the `_FOLD - 1 - j` blocks after it, through its own
    byte tables, and the run XORed together. Zero registers in front stand for zero bytes, which
    change nothing, and fill the first run.
    """
    num_runs = -(-len(registers) // _FOLD)
    runs = np.zeros(num_runs * _FOLD, dtype=np.uint32)
    runs[len(runs) - len(registers) :] = registers
    runs = runs.reshape(num_runs, _FOLD)
    tables, row_starts = _fold_tables(span)
    folded = tables[row_starts[0] + (runs & 0xFF)]
    for byte in range(1, 4):
        folded ^= tables[row_starts[byte] + ((runs >> (8 * byte)) & 0xFF)]
    return np.bitwise_xor.reduce(folded, axis=1)


# ---------------------------------------------------------------------- the linear maps


@functools.cache
def _byte_table() -> np.ndarray:
    """The register after one zero byte, for each value of its low byte (the classic table)."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLYNOMIAL), table >> 1)
    return table.astype(np.uint32)


@functools.cache
def _byte_table_list() -> list[int]:
    return _byte_table().tolist()


def _apply(tables: np.ndarray, registers: np.ndarray) -> np.ndarray:
    """A linear map of 32-bit registers, given as its 4 byte tables (one per register byte)."""
    out = tables[0][registers & 0xFF]
    out ^= tables[1][(registers >> 8) & 0xFF]
    out ^= tables[2][(registers >> 16) & 0xFF]
    out ^= tables[3][registers >> 24]
    return out


@functools.cache
def _zeros_columns(num_bytes: int) -> np.ndarray:
    """The map "feed `num_bytes` zero bytes" as its 32 columns: the image of each register bit."""
    if num_bytes == 1:
        bits = np.uint32(1) << np.arange(32, dtype=np.uint32)
        return _byte_table()[bits & 0xFF] ^ (bits >> 8)
    half = num_bytes // 2
    columns = _apply(_zeros_tables(half), _zeros_columns(num_bytes - half))
    return columns.astype(np.uint32)


@functools.cache
def _zeros_tables(num_bytes: int) -> np.ndarray:
    """The map "feed `num_bytes` zero bytes" as 4 byte tables [4, 256]."""
    return _byte_tables_of(_zeros_columns(num_bytes).reshape(4, 8))


def _byte_tables_of(columns: np.ndarray) -> np.ndarray:
    """A linear map's 4 byte tables [4, 256] from its columns, grouped by register byte [4, 8]."""
    bit_set = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)
    picked = np.where(bit_set[None, :, :], columns[:, None, :], np.uint32(0))
    return np.bitwise_xor.reduce(picked, axis=2).astype(np.uint32)


@functools.cache
def _sixteen_bit_tables(num_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The map "feed `num_bytes` zero bytes" on the low and on the high 16 register bits."""
    tables = _zeros_tables(num_bytes)
    low = np.arange(1 << 16, dtype=np.uint32)
    low_half = tables[0][low & 0xFF] ^ tables[1][low >> 8]
    high_half = tables[2][low & 0xFF] ^ tables[3][low >> 8]
    return low_half, high_half


def _step_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tables of one 8-byte step: the register (XOR its first word) over 8 bytes, the second word
    over 4."""
    return (*_sixteen_bit_tables(8), *_sixteen_bit_tables(4))


@functools.cache
def _fold_tables(span: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat byte tables of `_fold` for blocks of `span` bytes, and where each table starts.

    Table (j, byte) maps byte `byte` of a register to its share after `(_FOLD - 1 - j) * span`
    zero bytes; it starts at ``row_starts[byte][j]``.
    """
    columns = [np.uint32(1) << np.arange(32, dtype=np.uint32)]  # the identity: advance by 0
    for _ in range(_FOLD - 1):
        columns.append(_apply(_zeros_tables(span), columns[-1]))
    columns = np.stack(columns[::-1]).reshape(_FOLD, 4, 8)
    tables = np.stack([_byte_tables_of(c) for c in columns])  # [_FOLD, 4, 256]
    row_starts = (np.arange(_FOLD)[None, :] * 4 + np.arange(4)[:, None]) * 256
    return tables.reshape(-1), row_starts.astype(np.uint32)
