"""Local worker processes: `specq worker --device D` started, stopped gracefully, reaped.

- start: on the device running the fewest workers (ties: the order of `devices`), which is
  round-robin from an empty fleet and refills the device a crashed worker left. Service URLs reach the
  child through its environment, never its command line (which `ps` shows to every user). On Linux the
  child also gets SIGTERM if this process dies (PR_SET_PDEATHSIG), so even a killed autoscaler leaves
  no worker behind;
- stop: SIGTERM (the worker finishes the batch in hand and gives the rest of its chunk back), then
  SIGKILL once `grace_s` has passed (its leases then expire and a sweeper requeues its requests);
- reap: collect exited workers; one that exits on its own within `min_uptime_s` counts as a crash, and
  starts then back off exponentially, so a broken setup does not spin;
- give up a device: a worker that exits with a start-failure code (3: the device is unusable, 4: the
  models do not load there; `worker.startup`) or within `failed_start_s` failed to start. After
  `give_up_after` such failures in a row on one device (a worker that stays up `min_uptime_s` resets
  the count), that device is given up, said once in the log, and gets no worker until this process
  restarts: a host missing a GPU of `--devices` ends up served by the GPUs it has.
- metrics: each worker serves Prometheus metrics on `metrics_port + slot`, its slot the lowest one no
  other worker (running or stopping) holds, so the ports stay in a fixed range Prometheus lists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from specq.worker.autoscale.config import AutoscaleConfig
from specq.worker.startup import START_FAILURE_CODES

log = logging.getLogger(__name__)

# `specq worker` without relying on the console script being on PATH; -P keeps the folder the
# autoscaler runs in off sys.path, so a user's own `models.py` or `db/` there is never imported
WORKER_COMMAND = (sys.executable, "-P", "-m", "specq", "worker")


def _die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ManagedWorker:
    index: int  # 0, 1, 2 ... in start order, for log file names
    device: str
    slot: int  # its metrics port is metrics_port + slot
    process: subprocess.Popen[bytes]
    started_at: float
    log_file: IO[bytes] | None = None
    stop_deadline: float | None = None  # set when SIGTERM was sent: SIGKILL after it
    killed: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None


@dataclass
class Supervisor:
    config: AutoscaleConfig
    env: Mapping[str, str]  # the workers' environment (service URLs included)
    log_dir: Path | None = None  # None: workers write to this process's stderr
    command: Sequence[str] = WORKER_COMMAND
    clock: Callable[[], float] = time.monotonic
    workers: list[ManagedWorker] = field(default_factory=list)
    _started: int = 0
    _quick_exits: int = 0  # consecutive crashes within min_uptime_s
    _start_after: float = 0.0
    _failed_starts: dict[str, int] = field(default_factory=dict)  # per device, in a row
    given_up: set[str] = field(default_factory=set)

    # -- what runs ---------------------------------------------------------------------------------
    def running(self) -> list[ManagedWorker]:
        """Workers alive and not told to stop."""
        return [w for w in self.workers if not w.stopping and w.process.poll() is None]

    def stopping(self) -> list[ManagedWorker]:
        return [w for w in self.workers if w.stopping]

    def usable_devices(self) -> list[str]:
        return [d for d in self.config.devices if d not in self.given_up]

    def next_device(self) -> str:
        usable = self.usable_devices()
        load = {device: 0 for device in usable}
        for w in self.running():
            if w.device in load:
                load[w.device] += 1
        return min(usable, key=lambda d: load[d])  # min keeps the first of equals

    def can_start(self) -> bool:
        return self.clock() >= self._start_after and bool(self.usable_devices())

    def _free_slot(self) -> int:
        taken = {w.slot for w in self.workers}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def _metrics_args(self, slot: int) -> list[str]:
        if self.config.metrics_port is None:
            return ["--metrics-port", "0"]
        return ["--metrics-port", str(self.config.metrics_port + slot)]

    # -- changes -----------------------------------------------------------------------------------
    def start(self) -> ManagedWorker:
        device = self.next_device()
        slot = self._free_slot()
        index = self._started
        self._started += 1
        log_file: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_file = open(self.log_dir / f"worker-{index}-{device.replace(':', '')}.log", "ab")  # noqa: SIM115
        out: IO[Any] | int = log_file if log_file is not None else sys.stderr
        kwargs: dict[str, Any] = {}
        if sys.platform.startswith("linux"):
            kwargs["preexec_fn"] = _die_with_parent
        process = subprocess.Popen(
            [*self.command, "--device", device, *self._metrics_args(slot)],
            env={**self.env, "SPECQ_METRICS_HOST": self.config.metrics_host},  # addresses stay off `ps`
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            **kwargs,
        )
        worker = ManagedWorker(index, device, slot, process, self.clock(), log_file)
        self.workers.append(worker)
        log.info("started worker %d (pid %d) on %s", index, process.pid, device)
        return worker

    def stop(self, worker: ManagedWorker) -> None:
        """SIGTERM now, SIGKILL after the grace period (done by `reap`)."""
        if worker.stopping:
            return
        worker.stop_deadline = self.clock() + self.config.grace_s
        self._signal(worker, signal.SIGTERM)
        log.info("stopping worker %d (pid %d) on %s", worker.index, worker.pid, worker.device)

    def pick_to_stop(self, count: int, idle_pids: set[int]) -> list[ManagedWorker]:
        """`count` running workers to stop: idle ones first, then the newest (the oldest have the
        warmest caches and the chunks furthest along)."""
        running = self.running()
        ranked = sorted(running, key=lambda w: (w.pid not in idle_pids, -w.started_at))
        return ranked[: max(0, count)]

    def reap(self) -> list[ManagedWorker]:
        """Collect exited workers, SIGKILL those past their grace; returns the workers that exited."""
        now = self.clock()
        exited = []
        for worker in list(self.workers):
            code = worker.process.poll()
            if code is None and now - worker.started_at >= self.config.min_uptime_s:
                self._failed_starts.pop(worker.device, None)  # the device serves: its failures are forgiven
            if code is None:
                if worker.stop_deadline is not None and now >= worker.stop_deadline and not worker.killed:
                    log.warning(
                        "worker %d (pid %d) still running %.0fs after SIGTERM; killing it",
                        worker.index,
                        worker.pid,
                        self.config.grace_s,
                    )
                    self._signal(worker, signal.SIGKILL)
                    worker.killed = True
                continue
            self.workers.remove(worker)
            exited.append(worker)
            if worker.log_file is not None:
                worker.log_file.close()
            if worker.stopping:
                log.info("worker %d (pid %d) stopped (exit %s)", worker.index, worker.pid, code)
                continue
            uptime = now - worker.started_at
            log.warning(
                "worker %d (pid %d) on %s exited by itself (exit %s) after %.0fs",
                worker.index,
                worker.pid,
                worker.device,
                code,
                uptime,
            )
            if code in START_FAILURE_CODES or uptime < self.config.failed_start_s:
                self._failed_start(worker.device, code)
            self._quick_exits = self._quick_exits + 1 if uptime < self.config.min_uptime_s else 0
            if self._quick_exits:
                delay = min(self.config.max_backoff_s, 2.0 ** (self._quick_exits - 1))
                self._start_after = now + delay
                log.warning("%d quick exits in a row: next start in %.0fs", self._quick_exits, delay)
        return exited

    def _failed_start(self, device: str, code: int) -> None:
        failures = self._failed_starts.get(device, 0) + 1
        self._failed_starts[device] = failures
        if failures >= self.config.give_up_after and device not in self.given_up:
            self.given_up.add(device)
            log.error(
                "giving up device %s: %d workers in a row failed to start there (last exit %s); no worker is "
                "placed on it until the autoscaler restarts",
                device,
                failures,
                code,
            )

    def stop_all(self, hurry: Callable[[], bool] = lambda: False, poll_s: float = 0.1) -> None:
        """SIGTERM every worker and wait for all to exit; SIGKILL those past their grace, or all of them
        at once when `hurry()` turns true (a second signal)."""
        for worker in self.workers:
            self.stop(worker)
        while self.workers:
            if hurry():
                for worker in self.workers:
                    if not worker.killed:
                        self._signal(worker, signal.SIGKILL)
                        worker.killed = True
            self.reap()
            if self.workers:
                time.sleep(poll_s)

    @staticmethod
    def _signal(worker: ManagedWorker, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile; reap collects it
            os.kill(worker.pid, sig)
