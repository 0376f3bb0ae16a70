"""Prometheus metrics of one worker, named as vLLM names its own (`vllm:spec_decode_num_drafts` ...).

prometheus_client accepts ':' in names (the Prometheus data model allows it), so the names are
`specq:...` exactly like vLLM's `vllm:...`; counters get the usual `_total` suffix on exposition.
Raw counters only: acceptance rate = accepted / draft tokens, mean acceptance length =
1 + accepted / drafts, both derived by whoever reads them (e.g. a PromQL `rate()` ratio).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from specq.decoding.stats import EngineStats

log = logging.getLogger(__name__)

LABELS = ("model_name", "device")


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
    request_success: Counter
    request_failure: Counter
    requests_running: Gauge
    requests_waiting: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> WorkerMetrics:
        r = registry or CollectorRegistry()
        return cls(
            registry=r,
            num_drafts=Counter("specq:spec_decode_num_drafts", "Drafts proposed.", LABELS, registry=r),
            num_draft_tokens=Counter(
                "specq:spec_decode_num_draft_tokens", "Draft tokens proposed.", LABELS, registry=r
            ),
            num_accepted_tokens=Counter(
                "specq:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", LABELS, registry=r
            ),
            num_accepted_tokens_per_pos=Counter(
                "specq:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                (*LABELS, "position"),
                registry=r,
            ),
            proposer_draft_tokens=Counter(
                "specq:spec_decode_num_draft_tokens_by_proposer",
                "Draft tokens proposed, by proposer (draft, ngram, suffix).",
                (*LABELS, "proposer"),
                registry=r,
            ),
            proposer_accepted_tokens=Counter(
                "specq:spec_decode_num_accepted_tokens_by_proposer",
                "Draft tokens accepted by the target, by proposer (draft, ngram, suffix).",
                (*LABELS, "proposer"),
                registry=r,
            ),
            generation_tokens=Counter("specq:generation_tokens", "Tokens generated.", LABELS, registry=r),
            prompt_tokens=Counter("specq:prompt_tokens", "Prompt tokens prefilled.", LABELS, registry=r),
            request_success=Counter("specq:request_success", "Requests completed.", LABELS, registry=r),
            request_failure=Counter("specq:request_failure", "Requests failed.", LABELS, registry=r),
            requests_running=Gauge(
                "specq:num_requests_running", "Requests in the engine's running batch.", LABELS, registry=r
            ),
            requests_waiting=Gauge(
                "specq:num_requests_waiting", "Claimed requests waiting for a batch slot.", LABELS, registry=r
            ),
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
        log.info("serving Prometheus metrics on %s:%d", addr, port)

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

    def set_load(self, model: str, device: str, outstanding: int, batch_size: int) -> None:
        """Outstanding claimed requests: up to batch_size of them run, the rest wait for a slot."""
        running = min(outstanding, batch_size)
        self.requests_running.labels(model, device).set(running)
        self.requests_waiting.labels(model, device).set(outstanding - running)
