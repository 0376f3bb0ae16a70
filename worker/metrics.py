"""Prometheus metrics of one worker, named as vLLM names its own, under a `specq_` prefix.

vLLM's `vllm:spec_decode_num_drafts` becomes `specq_spec_decode_num_drafts_total`: the name after the
prefix is vLLM's, so dashboards and queries port over, while the `_` prefix (not `:`, which Prometheus
reserves for recording rules), the `_total` suffix of counters and seconds as the unit are what
`promtool check metrics` asks for.

Raw counters only: acceptance rate = accepted / draft tokens, mean acceptance length =
1 + accepted / drafts, per-position acceptance = accepted_per_pos{position} / drafts; whoever reads them
derives the rates (a PromQL `rate()` ratio, as deploy/monitoring's dashboard does).

Timings, all histograms in seconds, per request unless said otherwise:
- queue time: from the job's enqueue to the claim of the request by a worker;
- end-to-end latency: from the job's enqueue to the request's result being stored;
- time to first token: in the engine, from the request's admission to a batch to its first token (the
  queue time is its own histogram: a batch job's queue wait would drown the engine's part);
- time per output token: the engine's time after the first token, per further token;
- chunk duration: one chunk task, claim to settle.

`specq_chunks_dead_lettered_total` counts the chunk messages this worker set aside because they named
another database than its own (`worker.serving`); any rise means a client submits to the wrong fleet.

Gauges of the loaded models: the seconds `--compile` took at load, and the decode-step speedup it
measured (decoding/compiled.py), per role (target, draft; warm_up: the decode that compiles the
engine's shapes, in seconds only).

`model_name` is the served name (the job's `served_model_name`, else the target's Hugging Face id, or the
folder name of a local target): never a path of the worker's disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import (
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationResult

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from specq.decoding.compiled import CompileOutcome

log = logging.getLogger(__name__)

LABELS = ("model_name", "device")
# a batch job waits minutes to hours in the queue: buckets from a tenth of a second to four hours
LONG_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
CHUNK_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)


def served_model_name(target: str, served: str | None = None) -> str:
    """The name a job's model is reported under: its served name (`--served-model-name`, stored with
    the job), else the target's id; a local folder is reported by its own name, so no path of this
    machine reaches a metrics page."""
    if served:
        return str(served)
    if os.path.isabs(target) or target.startswith(("./", "../", "~")) or Path(target).exists():
        return Path(target.rstrip("/")).name or "local"
    return target


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter
    proposer_draft_tokens: Counter
    proposer_accepted_tokens: Counter
    generation_tokens: Counter
    prompt_tokens: Counter
    prompt_tokens_reused: Counter
    request_success: Counter
    request_failure: Counter
    requests_running: Gauge
    requests_waiting: Gauge
    queue_time: Histogram
    e2e_latency: Histogram
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    chunk_duration: Histogram
    compile_seconds: Gauge
    compile_speedup: Gauge
    dead_lettered: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None, fleet: Collector | None = None) -> WorkerMetrics:
        """The worker's metrics in `registry` (a new one by default, with the process metrics), and the
        fleet's gauges from `fleet` when given (`worker.fleet_metrics`)."""
        r = registry
        if r is None:
            r = CollectorRegistry()
            r.register(PROCESS_COLLECTOR)
            r.register(PLATFORM_COLLECTOR)
        if fleet is not None:
            r.register(fleet)
        return cls(
            registry=r,
            num_drafts=Counter("specq_spec_decode_num_drafts", "Drafts proposed.", LABELS, registry=r),
            num_draft_tokens=Counter(
                "specq_spec_decode_num_draft_tokens", "Draft tokens proposed.", LABELS, registry=r
            ),
            num_accepted_tokens=Counter(
                "specq_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", LABELS, registry=r
            ),
            num_accepted_tokens_per_pos=Counter(
                "specq_spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                (*LABELS, "position"),
                registry=r,
            ),
            proposer_draft_tokens=Counter(
                "specq_spec_decode_num_draft_tokens_by_proposer",
                "Draft tokens proposed, by proposer (draft, ngram, suffix).",
                (*LABELS, "proposer"),
                registry=r,
            ),
            proposer_accepted_tokens=Counter(
                "specq_spec_decode_num_accepted_tokens_by_proposer",
                "Draft tokens accepted by the target, by proposer (draft, ngram, suffix).",
                (*LABELS, "proposer"),
                registry=r,
            ),
            generation_tokens=Counter("specq_generation_tokens", "Tokens generated.", LABELS, registry=r),
            prompt_tokens=Counter("specq_prompt_tokens", "Prompt tokens prefilled.", LABELS, registry=r),
            prompt_tokens_reused=Counter(
                "specq_prompt_tokens_reused",
                "Prompt tokens not prefilled: a head of the prompt that another row of the batch held.",
                LABELS,
                registry=r,
            ),
            request_success=Counter(
                "specq_request_success", "Requests completed.", (*LABELS, "finished_reason"), registry=r
            ),
            request_failure=Counter("specq_request_failure", "Requests failed.", LABELS, registry=r),
            requests_running=Gauge(
                "specq_num_requests_running", "Requests in the engine's running batch.", LABELS, registry=r
            ),
            requests_waiting=Gauge(
                "specq_num_requests_waiting", "Claimed requests waiting for a batch slot.", LABELS, registry=r
            ),
            queue_time=Histogram(
                "specq_request_queue_time_seconds",
                "From the job's enqueue to the request's claim by a worker.",
                LABELS,
                buckets=LONG_BUCKETS,
                registry=r,
            ),
            e2e_latency=Histogram(
                "specq_e2e_request_latency_seconds",
                "From the job's enqueue to the request's stored result.",
                LABELS,
                buckets=LONG_BUCKETS,
                registry=r,
            ),
            time_to_first_token=Histogram(
                "specq_time_to_first_token_seconds",
                "From the request's admission to a batch to its first token.",
                LABELS,
                buckets=TTFT_BUCKETS,
                registry=r,
            ),
            time_per_output_token=Histogram(
                "specq_time_per_output_token_seconds",
                "Engine time per output token after the first.",
                LABELS,
                buckets=TPOT_BUCKETS,
                registry=r,
            ),
            chunk_duration=Histogram(
                "specq_chunk_duration_seconds",
                "One chunk task, from claim to settle.",
                LABELS,
                buckets=CHUNK_BUCKETS,
                registry=r,
            ),
            compile_seconds=Gauge(
                "specq_model_compile_seconds",
                "Seconds this worker spent compiling and checking the model at load (--compile).",
                (*LABELS, "role"),
                registry=r,
            ),
            compile_speedup=Gauge(
                "specq_model_compile_speedup",
                "A decode step's eager over compiled time, as its compile measured it; 1 where it runs eagerly.",
                (*LABELS, "role"),
                registry=r,
            ),
            dead_lettered=Counter(
                "specq_chunks_dead_lettered",
                "Chunk messages set aside unrun: they named a database this worker does not serve.",
                ("device",),
                registry=r,
            ),
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> bool:
        """Serve /metrics on host:port; False (and a warning) when the port is taken: a worker without
        its metrics page still serves requests."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            log.warning("cannot serve Prometheus metrics on %s:%d (%s); serving without them", host, port, exc)
            return False
        log.info("serving Prometheus metrics on %s:%d", host, port)
        return True

    def add_stats(self, model: str, device: str, stats: EngineStats) -> None:
        """Add one batch's engine counters."""
        labels = (model, device)
        self.num_drafts.labels(*labels).inc(stats.num_drafts)
        self.num_draft_tokens.labels(*labels).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(*labels).inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.num_accepted_tokens_per_pos.labels(*labels, str(position)).inc(accepted)
        for proposer, counters in stats.by_proposer.items():
            self.proposer_draft_tokens.labels(*labels, proposer).inc(counters["draft_tokens"])
            self.proposer_accepted_tokens.labels(*labels, proposer).inc(counters["accepted_tokens"])
        self.generation_tokens.labels(*labels).inc(stats.num_generated_tokens)
        self.prompt_tokens.labels(*labels).inc(stats.prefill_tokens)
        self.prompt_tokens_reused.labels(*labels).inc(stats.prompt_tokens_reused)

    def add_results(self, model: str, device: str, results: list[GenerationResult], since_enqueue_s: float) -> None:
        """Count stored results; `since_enqueue_s`: seconds from the job's enqueue to now (the store)."""
        labels = (model, device)
        for result in results:
            if result.error is not None:
                self.request_failure.labels(*labels).inc()
                continue
            self.request_success.labels(*labels, result.finish_reason or "stop").inc()
            self.e2e_latency.labels(*labels).observe(since_enqueue_s)
            if result.first_token_s is not None:
                self.time_to_first_token.labels(*labels).observe(result.first_token_s)
                if result.completion_tokens > 1:
                    per_token = (result.latency_s - result.first_token_s) / (result.completion_tokens - 1)
                    self.time_per_output_token.labels(*labels).observe(max(0.0, per_token))

    def set_compiled(self, model: str, device: str, compiled: Mapping[str, CompileOutcome], warm_up_s: float) -> None:
        """What `--compile` did with each model of the pair (role: target, draft) when it was loaded, and
        the warm-up decode through the compiled models (role: warm_up)."""
        if compiled:
            self.compile_seconds.labels(model, device, "warm_up").set(warm_up_s)
        for role, outcome in compiled.items():
            self.compile_seconds.labels(model, device, role).set(outcome.seconds)
            self.compile_speedup.labels(model, device, role).set(
                outcome.speedup if outcome.compiled and outcome.speedup else 1.0
            )

    def set_load(self, model: str, device: str, outstanding: int, batch_size: int) -> None:
        """Outstanding claimed requests: up to batch_size of them run, the rest wait for a slot."""
        running = min(outstanding, batch_size)
        self.requests_running.labels(model, device).set(running)
        self.requests_waiting.labels(model, device).set(outstanding - running)
