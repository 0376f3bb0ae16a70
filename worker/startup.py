"""What a worker checks before it takes any work, and the exit codes that say why it would not start.

A worker bound to a device it cannot use (`--device cuda:3` on a host with two GPUs, or a CPU-only
torch) must never claim a chunk: it would fail every request it took. It exits before consuming, with
one line and `EXIT_DEVICE_UNUSABLE`; one whose models do not load (disk full, weights gone, permissions)
gives its chunk back and exits with `EXIT_MODEL_UNLOADABLE`. The autoscaler reads both codes as a failed
start on that device (`worker.autoscale.supervisor`).
"""

from __future__ import annotations

from specq.errors import ModelFetchError, WorkerUnusableError

EXIT_DEVICE_UNUSABLE = 3
EXIT_MODEL_UNLOADABLE = 4
START_FAILURE_CODES = frozenset({EXIT_DEVICE_UNUSABLE, EXIT_MODEL_UNLOADABLE})


def check_device(device: str) -> None:
    """Raise WorkerUnusableError (exit 3) unless torch can place a tensor on `device`."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise _unusable(device, f"not a torch device ({exc})") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise _unusable(device, "torch sees no CUDA device on this host")
        count = torch.cuda.device_count()
        if (parsed.index or 0) >= count:
            raise _unusable(device, f"this host has {count} CUDA device{'s' if count != 1 else ''}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise _unusable(device, "MPS is not available on this host")
    try:
        torch.zeros(1, device=parsed)  # the check that counts: a driver or build problem shows here
    except (RuntimeError, AssertionError) as exc:  # AssertionError: "Torch not compiled with CUDA enabled"
        raise _unusable(device, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None


def _unusable(device: str, reason: str) -> WorkerUnusableError:
    return WorkerUnusableError(f"device {device} is unusable: {reason}; not taking work", EXIT_DEVICE_UNUSABLE)


def is_worker_side_load_failure(exc: BaseException) -> bool:
    """A model load that failed because of this worker (I/O, permissions, memory, the device), not
    because of the job: the loader wraps such errors, so their cause is an OSError or RuntimeError; and a
    catalogue model this worker cannot fetch, or may not (`--no-pull-models`), which another worker may hold."""
    if isinstance(exc, ModelFetchError):
        return True
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return isinstance(cause, OSError | RuntimeError | MemoryError)
