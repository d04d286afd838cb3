"""Prometheus metrics of one server (its own registry, so several servers in one process do
not share counters). Only what the server measures: no drafter runs here, so there is no
speculative-acceptance series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("muser_queue_depth", "requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("muser_slots_busy", "slots serving a request", registry=r)
        self.slots_total = Gauge("muser_slots_total", "slots configured", registry=r)
        self.slots_total.set(slots)
        self.ttft = Histogram("muser_time_to_first_token_seconds", "submit to first sampled token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("muser_inter_token_latency_seconds", "between consecutive sampled tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("muser_prompt_tokens", "prompt tokens received", registry=r)
        self.cached_tokens = Counter("muser_cached_prompt_tokens", "prompt tokens served from a named session's KV",
                                     registry=r)
        self.completion_tokens = Counter("muser_completion_tokens", "tokens sampled", registry=r)
        self.prefills = Counter("muser_prefills", "prompts prefilled through the prefill node, by path: remote, or "
                                "local (the node refused or was unreachable)", ["path"], registry=r)
        self.prefilled_tokens = Counter("muser_prefilled_tokens", "prompt tokens run through this server's model",
                                        registry=r)
        self.restored_tokens = Counter("muser_restored_tokens", "prompt tokens restored from the kvpack store",
                                       registry=r)
        self.steps = Counter("muser_engine_steps", "Engine.step calls of the engine loop (one forward each)", registry=r)
        self.step_sequences = Histogram("muser_step_sequences", "sequences (slots) whose rows one step carried",
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.step_rows = Histogram("muser_step_rows", "token rows one step carried (decode rows + prompt rows)",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.requests = Counter("muser_requests", "finished HTTP requests", ["endpoint", "status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
