"""Prometheus metrics of one server (a registry per app, so tests can run several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]


class ServerMetrics:
    """The counters and histograms ``/metrics`` exposes (names prefixed ``distill_``).

    tokens per step
        tokens one sequence gained in one decoding step (1 for plain decoding; with
        Medusa, 1 + accepted speculated tokens): its mean is the acceleration rate.
    step latency
        wall-clock seconds of one engine decoding step (one forward pass of the batch).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("distill_requests", "HTTP API requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("distill_prompt_tokens", "Prompt tokens of finished sequences", registry=r)
        self.generation_tokens = Counter("distill_generation_tokens", "Tokens generated (sent to clients)", registry=r)
        self.sequences = Counter("distill_sequences", "Finished sequences by finish reason", ["finish_reason"], registry=r)
        self.tokens_per_step = Histogram(
            "distill_tokens_per_step", "Tokens a sequence gained in one decoding step (acceleration rate = mean)",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16), registry=r,
        )
        self.step_latency = Histogram(
            "distill_step_latency_seconds", "Wall-clock time of one engine decoding step",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0), registry=r,
        )
        self.prefill_latency = Histogram(
            "distill_prefill_seconds", "Wall-clock time of a prefill (the prompts joining the running batch)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=r,
        )
        self.request_latency = Histogram(
            "distill_request_seconds", "Time from a request's arrival to its last token",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0), registry=r,
        )
        self.batch_size = Histogram("distill_batch_size", "Sequences decoding together, per decoding step", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.queue_depth = Gauge("distill_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("distill_running_sequences", "Sequences the engine is decoding", registry=r)
        self.tokenizing = Gauge("distill_tokenizing_requests", "Requests whose prompts are being rendered and tokenized (on a worker thread)",
                                registry=r)
        self.tree_nodes = Histogram(
            "distill_tree_nodes", "Speculated tree nodes verified per decoding step (0 = a plain step; the policy's choice)",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )
        self.acceptance_ratio = Gauge(
            "distill_acceptance_ratio", "Measured / calibrated accepted tokens per step (the adaptive policy's rho; 1 = as calibrated)",
            registry=r,
        )
        self.proposer = Gauge("distill_proposer", "The proposer that drafts (1 for the one running): medusa, eagle3, lookup or none",
                              ["proposer"], registry=r)
        self.rejected = Counter("distill_rejected_requests", "Requests refused with 503 because the queue was full", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
