"""The autoscaler's settings: one frozen dataclass (nanoGPT's GPTConfig style), validated on creation."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?|xpu(:\d+)?)$")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int = 0  # 0: scale to zero when idle (a GPU left idle costs as much as a busy one)
    max_workers: int = 1
    devices: tuple[str, ...] = ("cpu",)  # workers are placed round-robin on these
    # requests (queued + running) one worker is expected to take: with the default chunking, 8 chunks of
    # 32 requests; enough work to pay for loading the models, little enough to spread a job out
    backlog_per_worker: int = 256
    # a worker is stopped only after the backlog asked for fewer workers for this long: model loading
    # takes tens of seconds, so a short lull must not cost a reload
    cooldown_s: float = 60.0
    interval_s: float = 5.0  # how often the backlog is read
    # SIGTERM -> SIGKILL: a stopping worker finishes the batch in hand (minutes at most for long
    # completions on a large model) and gives the rest back; past this it is killed and its leases expire
    grace_s: float = 300.0
    # a worker that exits within this time of starting counts as a crash: restarts then back off,
    # 1, 2, 4 ... up to max_backoff_s, so a broken setup does not spin
    min_uptime_s: float = 30.0
    max_backoff_s: float = 60.0
    # a worker that exits by itself with code 3 or 4 (`worker.startup`: unusable device, models that do
    # not load) or within failed_start_s of starting failed to start; after give_up_after such failures in
    # a row on one device, no worker is placed there again until the autoscaler restarts
    failed_start_s: float = 10.0
    give_up_after: int = 3
    # worker i of the running fleet serves its metrics on metrics_port + i (i reused, so the ports stay
    # within metrics_port .. metrics_port + max - 1, a fixed list for Prometheus); None: no metrics
    metrics_port: int | None = 9100
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise ValueError(f"min must be >= 0, got {self.min_workers}")
        if self.max_workers < max(1, self.min_workers):
            raise ValueError(f"max must be >= 1 and >= min ({self.min_workers}), got {self.max_workers}")
        if not self.devices:
            raise ValueError("devices must name at least one device")
        for device in self.devices:
            if not _DEVICE.match(device):
                raise ValueError(f"not a device: {device!r} (expected cpu, cuda, cuda:N)")
        if self.backlog_per_worker < 1:
            raise ValueError(f"backlog per worker must be >= 1, got {self.backlog_per_worker}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown must be >= 0, got {self.cooldown_s}")
        if self.interval_s <= 0:
            raise ValueError(f"interval must be > 0, got {self.interval_s}")
        if self.grace_s <= 0:
            raise ValueError(f"grace must be > 0, got {self.grace_s}")
        if self.min_uptime_s < 0 or self.max_backoff_s < 0 or self.failed_start_s < 0:
            raise ValueError("min_uptime_s, max_backoff_s and failed_start_s must be >= 0")
        if self.give_up_after < 1:
            raise ValueError(f"give up after must be >= 1, got {self.give_up_after}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535 - self.max_workers + 1:
            raise ValueError(f"metrics ports {self.metrics_port}..+{self.max_workers - 1} must lie within 1..65535")


def parse_devices(text: str) -> tuple[str, ...]:
    """`cuda:0,cuda:1` -> ("cuda:0", "cuda:1"); blanks around commas are ignored."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def default_devices() -> tuple[str, ...]:
    """Every GPU this process sees (CUDA_VISIBLE_DEVICES applies), else the CPU."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(f"cuda:{i}" for i in range(count)) or ("cpu",)
