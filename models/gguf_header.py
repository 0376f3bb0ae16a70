"""A GGUF file's header, walked with bounded reads before any GGUF reader sees the file.

gguf's `GGUFReader` (transformers reads GGUF files with it) builds a numpy view for every key, array
element and tensor that the header declares, and checks none of their counts against the file's size
first: a 119 MB file declaring three million tiny tensors held `run` silent until memory ran out. So
the header is walked here first, through a memory map (no copy of the file), and every count and length
is checked against the bytes left in the file and against caps far past any real model's
(specq.limits.GGUF_*), and each tensor's data against the end of the file. A file that fails is refused
in one line before anything is built; one that passes costs its reader what a real model costs.

The layout (GGUF versions 2 and 3, ggml's docs/gguf.md): the magic `GGUF`, the version (u32), the tensor
count and the key count (u64 each); the keys (a string, a value type u32, a value); the tensor infos (a
name string, a dimension count u32, the dimensions u64 each, a ggml type u32, a data offset u64);
padding to the alignment; the tensor data. A string is a u64 length and its bytes; an array is an
element type u32, a count u64 and the elements. Little-endian, or all big-endian (then the version
reads as a multiple of 65,536, as gguf's reader tells them apart).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from specq.errors import ModelLoadError
from specq.limits import (
    CHAT_TEMPLATE_BYTES,
    GGUF_ARRAY_DEPTH,
    GGUF_ARRAY_ITEMS,
    GGUF_DIMENSIONS,
    GGUF_KEYS,
    GGUF_TENSORS,
)

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # those gguf's reader reads
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"  # and `tokenizer.chat_template.NAME`, a named one
# value types: their sizes, where fixed (u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64)
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32, STRING, ARRAY = 4, 8, 9
NAME_BYTES = 65_535  # the GGUF specification's limit on a key; tensor names are shorter still (64)
NAME_QUOTED = 100  # of a tensor's name, kept for a message
# the fewest bytes a key or a tensor info takes: a name's length, a type, a value of one byte / no
# dimensions, a type and an offset
SMALLEST_KEY = 8 + 4 + 1
SMALLEST_TENSOR_INFO = 8 + 4 + 4 + 8


class Refused(Exception):
    """What is wrong with the header, in words for the user."""


def check_header(path: Path) -> None:
    """ModelLoadError, one line naming `path` and what is wrong, unless its header is one that a GGUF
    reader can build in bounded memory: every count within its cap and what the file can hold, every
    length within the file, every tensor's data inside it, and its chat template no larger than
    `--chat-template` may be."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < len(MAGIC) + 4 + 8 + 8:
                raise Refused(f"it has {size} bytes, too few for a GGUF header")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _Walk(data).header()
    except Refused as exc:
        raise ModelLoadError(f"cannot load the GGUF file {str(path)!r} ({exc})") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read the GGUF file {str(path)!r} ({exc.strerror or exc})") from None


@dataclass
class _Tensor:
    name: str
    offset: int  # from the start of the data section
    nbytes: int


class _Walk:
    """A cursor over the mapped file that reads only what it has checked is there."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.size, self.at = data, len(data), 0
        self.order = "<"
        self.array_items = 0  # all keys' array elements so far
        self.alignment = DEFAULT_ALIGNMENT

    def header(self) -> None:
        if self.data[: len(MAGIC)] != MAGIC:
            raise Refused("it does not begin with GGUF: not a GGUF file")
        self.at = len(MAGIC)
        version = self.number("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in VERSIONS:
            raise Refused(
                f"GGUF version {version}, which cannot be read (versions {VERSIONS[0]} and {VERSIONS[1]} can)"
            )
        tensor_count = self.number("Q", "the tensor count")
        key_count = self.number("Q", "the key count")
        self.count(key_count, "keys", GGUF_KEYS, SMALLEST_KEY)
        self.count(tensor_count, "tensors", GGUF_TENSORS, SMALLEST_TENSOR_INFO)
        for index in range(key_count):
            self.key(index)
        tensors = [self.tensor_info(index) for index in range(tensor_count)]
        data_start = -(-self.at // self.alignment) * self.alignment
        for tensor in tensors:
            if data_start + tensor.offset + tensor.nbytes > self.size:
                raise Refused(f"the data of the tensor {tensor.name!r} runs past the end of the file (truncated?)")

    # -- the pieces ------------------------------------------------------------------------------------
    def number(self, code: str, what: str) -> int:
        width = struct.calcsize(code)
        if width > self.size - self.at:
            raise Refused(f"the header ends inside {what} (truncated?)")
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += width
        return int(value)

    def skip(self, nbytes: int, what: str) -> None:
        if nbytes > self.size - self.at:
            raise Refused(f"{what} runs past the end of the file ({nbytes} bytes declared)")
        self.at += nbytes

    def count(self, declared: int, what: str, cap: int, smallest: int) -> None:
        """A declared count of things each at least `smallest` bytes long, checked before any is read."""
        if declared > cap:
            raise Refused(f"its header declares {declared} {what}, over the limit of {cap}")
        if declared * smallest > self.size - self.at:
            raise Refused(f"its header declares {declared} {what}, more than its {self.size} bytes can hold")

    def name(self, what: str) -> str:
        """A key's or a tensor's name (messages quote it with repr, which escapes what could forge a line)."""
        length = self.number("Q", what)
        if length > NAME_BYTES:
            raise Refused(f"{what} has {length} bytes, over the limit of {NAME_BYTES}")
        start = self.at
        self.skip(length, what)
        return bytes(self.data[start : self.at]).decode("utf-8", errors="replace")

    def key(self, index: int) -> None:
        name = self.name(f"the name of key {index}")
        kind = self.number("I", f"the type of the key {name!r}")
        if name == ALIGNMENT_KEY and kind == UINT32:
            self.alignment = self.number("I", f"the key {name!r}")
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise Refused(f"its alignment is {self.alignment}, not a power of two")
            return
        if kind == STRING and (name == CHAT_TEMPLATE_KEY or name.startswith(CHAT_TEMPLATE_KEY + ".")):
            self.chat_template(name)
            return
        self.value(kind, name, depth=0)

    def chat_template(self, name: str) -> None:
        """The same limit as `--chat-template`'s: a template is code that every chat line runs."""
        length = self.number("Q", f"the key {name!r}")
        if length > CHAT_TEMPLATE_BYTES:
            raise Refused(
                f"its chat template ({name!r}) has {length} bytes, over the limit of {CHAT_TEMPLATE_BYTES >> 10} KiB "
                "(as for --chat-template)"
            )
        self.skip(length, f"the key {name!r}")

    def value(self, kind: int, name: str, depth: int) -> None:
        if kind in FIXED_SIZES:
            self.skip(FIXED_SIZES[kind], f"the key {name!r}")
        elif kind == STRING:
            self.skip(self.number("Q", f"the key {name!r}"), f"the key {name!r}")
        elif kind == ARRAY:
            self.array(name, depth + 1)
        else:
            raise Refused(f"the key {name!r} has the unknown value type {kind}")

    def array(self, name: str, depth: int) -> None:
        if depth > GGUF_ARRAY_DEPTH:
            raise Refused(f"the key {name!r} nests arrays deeper than {GGUF_ARRAY_DEPTH}")
        kind = self.number("I", f"the key {name!r}")
        items = self.number("Q", f"the key {name!r}")
        self.array_items += items
        if self.array_items > GGUF_ARRAY_ITEMS:
            raise Refused(f"its arrays hold more than {GGUF_ARRAY_ITEMS} elements in all (the limit)")
        if kind in FIXED_SIZES:
            self.skip(items * FIXED_SIZES[kind], f"the key {name!r}")
        elif kind == STRING:
            self.skip_strings(items, name)
        elif kind == ARRAY:
            self.count(items, f"arrays in the key {name!r}", GGUF_ARRAY_ITEMS, 4 + 8)
            for _ in range(items):
                self.array(name, depth + 1)
        else:
            raise Refused(f"the key {name!r} has the unknown element type {kind}")

    def skip_strings(self, items: int, name: str) -> None:
        """`items` strings (a vocabulary: hundreds of thousands), each length checked before the next."""
        if items * 8 > self.size - self.at:
            raise Refused(f"the key {name!r} declares {items} strings, more than the file can hold")
        length_at = struct.Struct(self.order + "Q").unpack_from
        data, at, size = self.data, self.at, self.size
        for _ in range(items):
            if at + 8 > size:
                raise Refused(f"the key {name!r} runs past the end of the file")
            at += 8 + length_at(data, at)[0]
            if at > size:
                raise Refused(f"a string of the key {name!r} runs past the end of the file")
        self.at = at

    def tensor_info(self, index: int) -> _Tensor:
        name = self.name(f"the name of tensor {index}")
        dimensions = self.number("I", f"the tensor {name!r}")
        if dimensions > GGUF_DIMENSIONS:
            raise Refused(f"the tensor {name!r} has {dimensions} dimensions, over the limit of {GGUF_DIMENSIONS}")
        elements = 1
        for _ in range(dimensions):
            elements *= self.number("Q", f"the tensor {name!r}")
        kind = self.number("I", f"the tensor {name!r}")
        offset = self.number("Q", f"the tensor {name!r}")
        block, block_bytes = _block_sizes().get(kind, (0, 0))
        if block == 0:
            raise Refused(f"the tensor {name!r} has the unknown ggml type {kind}")
        if elements % block:
            raise Refused(f"the tensor {name!r} has {elements} elements, not whole blocks of {block}")
        return _Tensor(name[:NAME_QUOTED], offset, elements // block * block_bytes)


@lru_cache(maxsize=1)
def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (elements a block, bytes a block), from the gguf package (the extra; present by now)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
