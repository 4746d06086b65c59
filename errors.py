"""The pack's one error hierarchy. Every error the pack raises on purpose is an :class:`H3TurboError`.

    H3TurboError
    ├── CheckpointError        a checkpoint file is damaged or not what the loader needs (ValueError)
    ├── TurboLoRAError         a Turbo LoRA file that cannot be used (ValueError)
    ├── TurboContractError     a sampling-time violation of a Turbo contract (ValueError)
    ├── CoverageError          Turbo LoRA targets that did not run in a diffusion-model call (RuntimeError)
    ├── NoCapablePathError     a compute path / attention backend this device cannot run (ValueError, RuntimeError)
    ├── InputError             a node input value that is not allowed (NaN, Inf, out of range) (ValueError)
    └── SequenceParallelError  H3 Turbo Multi-GPU cannot run, or a worker failed (RuntimeError)

The extra built-in bases keep ``except ValueError`` / ``except RuntimeError`` callers working. Messages
name the file, the key and what was expected. ComfyUI shows errors as ``<module>.<class>: message``;
the pack's module path depends on its install folder, so every class reports the module ``h3_turbo``.
No imports beyond the standard library: importable anywhere.
"""
from __future__ import annotations


class H3TurboError(Exception):
    """Base of every error the pack raises on purpose."""


class CheckpointError(H3TurboError, ValueError):
    """A checkpoint file is damaged or not what the loader needs.

    Attributes: ``path`` (str), ``key`` (tensor or metadata key, or None), ``cause`` (str),
    ``expected`` (str or None). ``str(err)`` is ``"<path>: tensor '<key>': <cause> (expected <expected>)"``.
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


class TurboLoRAError(H3TurboError, ValueError):
    """A Turbo LoRA file that cannot be used (message names the file, the keys and what was expected)."""


class TurboContractError(H3TurboError, ValueError):
    """A sampling-time violation of a Turbo contract (wrong steps, grid, CFG, cache, shift patch)."""


class CoverageError(H3TurboError, RuntimeError):
    """Some Turbo LoRA targets did not run during a diffusion-model call."""


class NoCapablePathError(H3TurboError, ValueError, RuntimeError):
    """A requested compute path or attention backend cannot run on this device; the message lists why
    (every candidate's reason when ``auto`` found none)."""


class InputError(H3TurboError, ValueError):
    """A node input value that is not allowed: not a finite number, or outside the input's range. The message
    names the node, the input, the value and the range (``nodes/checks.py``)."""


class SequenceParallelError(H3TurboError, RuntimeError):
    """H3 Turbo Multi-GPU cannot run this request (missing ``[multigpu]`` extra, a GPU count that does not divide the
    heads, a MODEL part that cannot travel to the workers, an unsupported core), or a worker failed, timed out or was
    stopped; the message names what was expected and, for a worker failure, carries the worker's own message."""


#: the name the pack used before the hierarchy existed
TurboCoverageError = CoverageError

for _cls in (H3TurboError, CheckpointError, TurboLoRAError, TurboContractError, CoverageError, NoCapablePathError,
             InputError, SequenceParallelError):
    _cls.__module__ = "h3_turbo"
del _cls
