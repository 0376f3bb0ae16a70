"""Models stay loaded between chunks: a small LRU keyed by (target, draft, dtype, device, compile)."""

from __future__ import annotations

import gc
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specq.models.loading import ModelPair

log = logging.getLogger(__name__)

CacheKey = tuple[str, str | None, str | None, str, str]  # (target, draft, dtype, device, compile)


class ModelCache:
    """At most `capacity` model pairs; the least recently used one is dropped to load a new one."""

    def __init__(self, capacity: int = 1, compile: str = "auto") -> None:
        # 1 by default: a GPU rarely holds two target models, and jobs of one model come in runs
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.compile = compile  # `specq worker --compile`: for jobs whose own setting is auto
        self._pairs: OrderedDict[CacheKey, ModelPair] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self,
        target: str,
        draft: str | None,
        dtype: str | None,
        device: str,
        compile: str = "auto",
        on_load: Callable[[], None] | None = None,
    ) -> ModelPair:
        """The pair, loaded if it is not; `compile` is the job's setting (auto: this worker's own);
        `on_load` is called before a load (not for a pair already loaded), which can take minutes."""
        from specq.models.loading import load_pair

        compile = self.compile if compile == "auto" else compile
        key = (target, draft, dtype, device, compile)
        with self._lock:
            pair = self._pairs.get(key)
            if pair is not None:
                self._pairs.move_to_end(key)
                return pair
            while len(self._pairs) >= self.capacity:
                old_key, _ = self._pairs.popitem(last=False)
                log.info("unloading %s / %s from %s", old_key[0], old_key[1], old_key[3])
                _free_memory(device)
            if on_load is not None:
                on_load()
            # measured after a chunk (measure_compiled_speedups): a job's first tokens wait for no measurement
            pair = load_pair(target, draft, device=device, dtype=dtype, compile=compile, measure_at_load=False)
            self._pairs[key] = pair
            return pair

    def measure_compiled_speedups(self) -> tuple[ModelPair, str] | None:
        """The pair used last and what measuring its compiled models found, where this machine keeps no
        speedup for them (ModelPair.measure_compiled_speedups); None where nothing was measured. For
        after a chunk's results are stored."""
        with self._lock:
            if not self._pairs:
                return None
            pair = next(reversed(self._pairs.values()))
            line = pair.measure_compiled_speedups()
        return None if line is None else (pair, line)

    def __len__(self) -> int:
        return len(self._pairs)


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
