"""Prometheus metrics of one server (a registry per app, so tests can run several apps in one process).

Two families: ours (``distill_*``) and vLLM's (``vllm:*``, :class:`VllmMetrics`), with the
names, labels (``model_name``, ``engine``), meanings and histogram buckets of the installed
vLLM's Prometheus logger, so dashboards and tools built for ``vllm serve`` read this server.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "VllmMetrics", "CONTENT_TYPE_LATEST"]


class ServerMetrics:
    """The counters and histograms ``/metrics`` exposes (names prefixed ``distill_``).

    tokens per step
        tokens one sequence gained in one decoding step (1 for plain decoding; with
        Medusa, 1 + accepted speculated tokens): its mean is the acceleration rate.
    step latency
        wall-clock seconds of one engine decoding step (one forward pass of the batch).
    """

    def __init__(self, model_name: str, speculative: bool, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.vllm = VllmMetrics(r, model_name, speculative, max_model_len)
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
        self.datastore_tokens = Gauge(
            "distill_lookup_datastore_tokens", "Generated tokens the lookup proposer's datastore indexes (--lookup-data; 0: none)",
            registry=r)
        self.history_tokens = Gauge(
            "distill_lookup_history_tokens", "Tokens of this server's earlier replies the lookup proposer drafts from "
            "(--lookup-history; 0: none)", registry=r)
        self.rejected = Counter("distill_rejected_requests", "Requests refused with 503 because the queue was full", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# vLLM's histogram buckets (vllm/v1/metrics/buckets.py): seconds, and token counts in a 1-2-5 series up to the context.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                   1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's metrics, recorded per sequence (vLLM's unit: each of ``n`` choices is an engine request of its own).

    Terms, as vLLM defines them:

    time to first token
        from the sequence's arrival (queued, its prompt tokenized) to its first generated token.
    inter-token latency
        between two consecutive decoding steps that gave the sequence tokens (one observation
        per step, however many tokens a speculative step gave).
    queue time
        from arrival to the engine taking the sequence into its batch; prefill time from there
        to the first token; decode time from the first to the last token; inference time the two.
    e2e latency
        from arrival to the sequence's end.
    draft (speculative decoding)
        one row's speculated tokens in one decoding step: the tree's nodes beyond the root (a
        step with no tree, 0 nodes, is no draft). Draft tokens: those nodes; accepted tokens:
        the nodes on the accepted path (the bonus token not counted); accepted at position k:
        drafts whose accepted path reached depth k + 1. Mean acceptance length =
        1 + accepted / drafts.
    engine step (``iteration_tokens_total``)
        one forward of the engine: a prefill (its prompt tokens plus each sequence's first
        token) or a decoding step (each row's accepted tokens plus its bonus token).
    parent request (``request_max_num_generation_tokens``, ``request_params_n``)
        one prompt's ``n`` choices: observed once all of them have ended, with the most tokens
        any of them generated.
    preemption
        a sequence taken out of the batch to be prefilled again: after a failed decoding step,
        the rows that step alone without failing go back to the waiting queue.
    KV-cache usage
        the KV slots the running sequences hold over the slots the engine has allocated (its
        cache grows with the batch, so this is the share of what is allocated; 0 when idle).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, speculative: bool, max_model_len: int):
        r, labels, values = registry, ["model_name", "engine"], (model_name, "0")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        tokens = token_buckets(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.num_preemptions = histogram("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
                                         PREEMPTION_BUCKETS)
        self.prefill_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.", labels + ["reason"],
                          registry=r)
        self.waiting_capacity = by_reason.labels(*values, "capacity")  # all of ours: the batch is full
        by_reason.labels(*values, "deferred").set(0)  # no LoRA budget, KV transfer or blocked status here
        admission = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
                            ["model_name", "reason"], registry=r)
        self.queue_full = admission.labels(model_name, "max_num_queued_reqs")  # --queue-size counts sequences
        admission.labels(model_name, "max_num_queued_tokens")  # no token limit on the queue: stays 0
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.", labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                REQUEST_BUCKETS)
        self.speculative = speculative
        if speculative:  # as vLLM: the counters exist only on a server that speculates
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                    labels + ["position"], registry=r)
            self._values = values
            self.accepted_per_pos: list[Counter] = []

    def step(self, drafted: list[int], accepted: list[int]) -> None:
        """One decoding step: ``drafted`` the nodes each row speculated (a row of a chain step drafts its own
        number, maybe none), ``accepted`` the accepted nodes of each row."""
        if not self.speculative or not any(drafted):
            return
        self.drafts.inc(sum(n > 0 for n in drafted))
        self.draft_tokens.inc(sum(drafted))
        self.accepted_tokens.inc(sum(accepted))
        deepest = max(accepted, default=0)
        while len(self.accepted_per_pos) < deepest:
            self.accepted_per_pos.append(self._per_pos.labels(*self._values, str(len(self.accepted_per_pos))))
        for k in range(deepest):
            self.accepted_per_pos[k].inc(sum(a > k for a in accepted))

    def parent_finished(self, n: int, most_generated: int) -> None:
        """All ``n`` choices of one prompt ended; the longest generated ``most_generated`` tokens."""
        self.params_n.observe(n)
        self.max_generation_tokens.observe(most_generated)

    def finished(self, reason: str, s, now: float) -> None:
        """Sequence ``s`` (:class:`distill.serve.scheduler.Sequence`) ended with ``reason`` at ``now`` (monotonic)."""
        arrived, scheduled, first, last = s.job.arrived, s.scheduled_at, s.first_token_at, s.last_token_at
        prompt_tokens, generated = len(s.prompt_ids), len(s.decoder.ids)
        self.success[reason if reason in self.success else "abort"].inc()
        self.params_max_tokens.observe(s.params.max_tokens)
        self.num_preemptions.observe(s.preemptions)
        self.prefill_computed.observe(s.prefill_tokens)  # re-prefills after preemptions included
        self.e2e.observe(now - arrived)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        if scheduled is None:
            return
        self.queue.observe(scheduled - arrived)
        if first is None:
            return
        self.prefill.observe(first - scheduled)
        last = last if last is not None else first
        self.decode.observe(last - first)
        self.inference.observe(last - scheduled)
        self.tpot.observe((last - first) / (generated - 1) if generated > 1 else 0.0)
