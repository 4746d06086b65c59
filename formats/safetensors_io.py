"""Safetensors container checks that read only the header (no tensor data), and streaming reads.

File layout (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian unsigned
header length ``n``, then ``n`` bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}``, then the data buffer. Offsets are relative to the
start of the data buffer (byte ``8 + n``); tensors tile the buffer exactly (no gaps, no overlap,
nothing after the last tensor).

Every problem raises :class:`CheckpointError`, whose message names the file, the key (when there is
one), the cause and the expected value.
"""
from __future__ import annotations

import json
import math
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field

# Bytes per element of every safetensors dtype string (F4 / F6 sub-byte types are not supported).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
LFS_PREFIX = b"version https://git-lfs"


class CheckpointError(ValueError):
    """A checkpoint file is damaged or not what the loader needs.

    Attributes: ``path`` (str), ``key`` (tensor or metadata key, or None), ``cause`` (str),
    ``expected`` (str or None). ``str(err)`` is ``"<path>: <key>: <cause> (expected <expected>)"``.
    """

    def __init__(self, path: str, cause: str, key: str | None = None, expected: str | None = None):
        self.path, self.key, self.cause, self.expected = str(path), key, cause, expected
        msg = f"{self.path}: "
        if key is not None:
            msg += f"tensor '{key}': "
        msg += cause
        if expected is not None:
            msg += f" (expected {expected})"
        super().__init__(msg)


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: safetensors dtype string, shape, [begin, end) byte offsets in the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Header:
    """A validated safetensors header. ``tensors`` keeps file order; ``metadata`` is ``__metadata__``."""

    path: str
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of ``path`` without reading tensor data.

    Checks, each with its own :class:`CheckpointError`: file exists and is at least 8 bytes; not a Git
    LFS pointer; header length within the file (and <= 100 MiB); header is a UTF-8 JSON object; each
    entry has a known dtype, a non-negative integer shape and offsets with ``end - begin ==
    prod(shape) * itemsize``; offsets inside the file (else "truncated"); tensors tile the data buffer
    without gaps or overlaps; no bytes after the last tensor.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise CheckpointError(path, "file not found")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(min(size, 64))
        if head.startswith(LFS_PREFIX):
            raise CheckpointError(path, "this is a Git LFS pointer file, not the model: the real file was "
                                        "never downloaded (run `git lfs pull` or download the file itself)",
                                  expected="a safetensors file")
        if size < 8:
            raise CheckpointError(path, f"file is {size} bytes, too small for a safetensors header",
                                  expected=">= 8 bytes")
        (n,) = struct.unpack("<Q", head[:8])
        if n > size - 8:
            raise CheckpointError(path, f"header length field says {n} bytes but the file has only "
                                        f"{size - 8} bytes after it (file truncated or not safetensors)",
                                  expected=f"<= {size - 8}")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(path, f"header length {n} bytes is larger than the safetensors limit",
                                  expected=f"<= {MAX_HEADER_BYTES}")
        f.seek(8)
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"header is not valid UTF-8 JSON ({e.__class__.__name__}: {e})",
                              expected="a JSON object") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(path, f"header JSON is a {type(hdr).__name__}", expected="a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    out = Header(path=path, file_size=size, data_start=data_start)
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(path, "__metadata__ is not a string-to-string map", key="__metadata__",
                              expected='{"name": "value", ...}')
    out.metadata = dict(meta)
    for name, ent in hdr.items():
        if not isinstance(ent, dict) or not {"dtype", "shape", "data_offsets"} <= set(ent):
            raise CheckpointError(path, f"header entry is malformed: {ent!r:.120}", key=name,
                                  expected='{"dtype", "shape", "data_offsets"}')
        dt, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
        if dt not in DTYPE_BYTES:
            raise CheckpointError(path, f"unknown dtype {dt!r}", key=name,
                                  expected="one of " + ", ".join(DTYPE_BYTES))
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(path, f"bad shape {shape!r}", key=name, expected="a list of non-negative ints")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
                or offs[0] < 0 or offs[1] < offs[0]):
            raise CheckpointError(path, f"bad data_offsets {offs!r}", key=name, expected="[begin, end], 0 <= begin <= end")
        want = math.prod(shape) * DTYPE_BYTES[dt]
        if offs[1] - offs[0] != want:
            raise CheckpointError(path, f"dtype {dt} shape {shape} needs {want} bytes but data_offsets "
                                        f"{offs} hold {offs[1] - offs[0]}", key=name, expected=f"{want} bytes")
        if offs[1] > data_len:
            raise CheckpointError(path, f"file is truncated: the tensor ends at data byte {offs[1]} but the file "
                                        f"holds only {data_len} data bytes ({offs[1] - data_len} missing; "
                                        "re-download the file)", key=name, expected=f"file size >= {data_start + offs[1]}")
        out.tensors[name] = TensorInfo(name, dt, tuple(shape), offs[0], offs[1])
    pos = 0
    for t in sorted(out.tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            cause = "overlaps the previous tensor" if t.begin < pos else f"leaves a gap of {t.begin - pos} bytes before it"
            raise CheckpointError(path, f"data_offsets {[t.begin, t.end]} {cause}", key=t.name,
                                  expected=f"begin == {pos}")
        pos = t.end
    if pos != data_len:
        raise CheckpointError(path, f"{data_len - pos} trailing bytes after the last tensor (the file was "
                                    "appended to or the header is wrong)", expected=f"data size {pos}")
    return out


@contextmanager
def open_tensors(path: str | os.PathLike, device: str = "cpu"):
    """Context manager over ``safetensors.safe_open(path, "pt")``: ``.get_tensor(key)`` reads one tensor.

    Reading one tensor at a time keeps peak memory at one tensor (streaming).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as f:
        yield f
