"""Safetensors container checks that read only the header (no tensor data), and streaming reads.

File layout (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian unsigned
header length ``n``, then ``n`` bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}``, then the data buffer. Offsets are relative to the
start of the data buffer (byte ``8 + n``); tensors tile the buffer exactly (no gaps, no overlap,
nothing after the last tensor).

Every problem raises :class:`CheckpointError` (the pack's one class, :mod:`h3_turbo.errors`, re-exported
here), whose message names the file, the key (when there is one), the cause and the expected value.
"""
from __future__ import annotations

import json
import math
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import CheckpointError  # noqa: F401 (re-exported: formats.safetensors_io.CheckpointError)

# Bytes per element of every safetensors dtype string (F4 / F6 sub-byte types are not supported).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
LFS_PREFIX = b"version https://git-lfs"


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
    LFS pointer; the header starts with ``{`` at byte 8 (else "not a safetensors file", naming a PyTorch pickle as
    one, which is never unpickled, instead of quoting a header length read from its bytes); header length within the file (and <= 100 MiB); header is a UTF-8 JSON object; each
    entry has a known dtype, a non-negative integer shape and offsets with ``end - begin ==
    prod(shape) * itemsize``; offsets inside the file (else "truncated"); tensors tile the data buffer
    without gaps or overlaps; no bytes after the last tensor.
    """
    path = str(path)
    if os.path.isdir(path):
        raise CheckpointError(path, "is a directory", expected="a .safetensors file")
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
        if size > 8 and head[8:9] != b"{":   # the header JSON starts at byte 8 and MUST begin with '{'
            raise _not_safetensors(path, head)
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
        out.tensors[name] = TensorInfo(name, dt, tuple(shape), offs[0], offs[1])
    beyond = [t for t in out.tensors.values() if t.end > data_len]
    if beyond:
        cut = min(beyond, key=lambda t: t.begin)   # the tensor the file stops inside (or first one missing)
        need = max(t.end for t in out.tensors.values())
        raise CheckpointError(path, f"file is truncated: it stops at data byte {data_len}, inside or before this "
                                    f"tensor (bytes {cut.begin}..{cut.end}); {len(beyond)} tensors incomplete, "
                                    f"{need - data_len} bytes missing (re-download the file)", key=cut.name,
                              expected=f"file size {data_start + need} bytes, found {size}")
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


#: extensions of PyTorch / pickle checkpoints (``torch.save``), which the pack never unpickles
PICKLE_EXTENSIONS = (".ckpt", ".pt", ".pth", ".pkl", ".pickle", ".bin")


def _not_safetensors(path: str, head: bytes) -> CheckpointError:
    """The error for a file whose first bytes are not a safetensors header (8-byte length, then ``{``): a PyTorch
    pickle (zip archive or raw pickle, or a pickle extension) says that pickles are not loaded, for safety; any
    other file says what it starts with. Never a header length read from bytes that are not one."""
    zip_archive, raw_pickle = head[:4] == b"PK\x03\x04", head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03",
                                                                                                b"\x04", b"\x05")
    if zip_archive or raw_pickle or path.lower().endswith(PICKLE_EXTENSIONS):
        what = ("a PyTorch checkpoint (torch.save zip archive with a pickle inside)" if zip_archive else
                "a Python pickle (PyTorch .ckpt / .pt checkpoint)" if raw_pickle else
                f"a {os.path.splitext(path)[1]} file (a PyTorch pickle checkpoint)")
        return CheckpointError(path, f"not a safetensors file: this is {what}. Pickle files are not loaded, for "
                                     "safety (unpickling can run arbitrary code)",
                               expected="a .safetensors file: use the safetensors release of this model, or convert "
                                        "the pickle to safetensors where you trust its source")
    text = head.decode("utf-8", errors="replace")
    if head and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        start = f"text ({text[:40]!r}...)"
    else:
        start = f"bytes {head[:16].hex(' ')}"
    return CheckpointError(path, f"not a safetensors file: it starts with {start}, not an 8-byte header length "
                                 "followed by the header's JSON '{'",
                           expected="a .safetensors file")


_TORCH_DTYPES = None


def torch_dtype(st_dtype: str):
    """torch dtype of a safetensors dtype string (F8_E8M0 needs torch >= 2.7)."""
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        _TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
                         "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16,
                         "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                         "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}
        if hasattr(torch, "float8_e8m0fnu"):
            _TORCH_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
    return _TORCH_DTYPES[st_dtype]


class TensorReader:
    """Reads single tensors of a validated safetensors file with plain positional reads (no mmap), so
    the process holds only the tensors it keeps: streaming conversion of a full-size file needs one tensor
    of memory, and no file pages are counted in the process's resident memory.
    """

    def __init__(self, path: str | os.PathLike, header: Header | None = None):
        self.header = header or read_header(path)
        self._f = open(self.header.path, "rb", buffering=0)

    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def metadata(self) -> dict[str, str]:
        return dict(self.header.metadata)

    def get_tensor(self, key: str):
        """The tensor ``key`` as a new CPU tensor (its own memory). KeyError if absent."""
        import torch

        t = self.header.tensors[key]
        buf = bytearray(t.nbytes)
        if not t.nbytes:
            return torch.empty(t.shape, dtype=torch_dtype(t.dtype))
        mv, pos, done = memoryview(buf), self.header.data_start + t.begin, 0
        self._f.seek(pos)
        while done < t.nbytes:          # a single read returns at most ~2 GiB on Linux
            n = self._f.readinto(mv[done:])
            if not n:
                raise CheckpointError(self.header.path, f"short read: got {done} of {t.nbytes} bytes (file changed "
                                                        "while reading?)", key=key, expected=f"{t.nbytes} bytes")
            done += n
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype(t.dtype)).reshape(t.shape)

    def close(self) -> None:
        self._f.close()


@contextmanager
def open_tensors(path: str | os.PathLike, device: str = "cpu", header: Header | None = None):
    """Context manager yielding a :class:`TensorReader` (``.get_tensor(key)`` reads one tensor).

    Reading one tensor at a time keeps peak memory at one tensor (streaming). ``device`` other than
    "cpu" moves each tensor there after reading.
    """
    r = TensorReader(path, header)
    try:
        if device == "cpu":
            yield r
        else:
            class _Moved:
                def get_tensor(self, key):
                    return r.get_tensor(key).to(device)

                def keys(self):
                    return r.keys()
            yield _Moved()
    finally:
        r.close()
