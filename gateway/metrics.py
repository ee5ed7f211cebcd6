"""Prometheus metrics, one registry per app (no module globals)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rlproxy_chat_requests",
            "chat calls recorded (every protocol), by status (ok; error: failed, or its client left) and stream",
            ["status", "stream"],
            registry=self.registry,
        )
        self.refused = Counter(
            "rlproxy_chat_refused",
            "chat calls answered with an error before any call row (a bad body, over a limit, the store "
            "unable to record), by HTTP status",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rlproxy_chat_latency_seconds",
            "seconds from a recorded chat call's start to its end (a stream's: its last chunk)",
            registry=self.registry,
            # Up to --upstream-timeout's 600 s: a long generation (agents, reasoning) takes minutes,
            # and a histogram ending at 60 s put every such call in +Inf, its quantiles at 60 s.
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        # A count of events: a counter (`_total`), so rate() and resets work as Prometheus expects.
        self.store_commits = Counter(
            "rlproxy_store_commits", "transactions committed by the writer", registry=self.registry
        )
        self._commits_seen = 0
        self.store_errors = Counter(
            "rlproxy_store_errors",
            "writes and reads the store failed, by cause (full, read_only, locked, moved, unavailable, damaged)",
            ["cause"],
            registry=self.registry,
        )
        self._store_errors_seen: dict[str, int] = {}
        self.store_degraded = Gauge("rlproxy_store_degraded", "1 while the store cannot record", registry=self.registry)
        self.model_step = Gauge("rlproxy_model_step", "step the alias NAME serves (-1: base)", registry=self.registry)
        # Promotion (gateway/promotion/): the step the store serves, the candidate under trial, decisions taken here.
        self.serving_step = Gauge("rlproxy_serving_step", "the serving step of NAME (-1: none)", registry=self.registry)
        self.candidate_step = Gauge("rlproxy_candidate_step", "the candidate step (-1: none)", registry=self.registry)
        self.decisions = Counter(
            "rlproxy_promotion_decisions", "canary decisions this gateway took", ["decision"], registry=self.registry
        )
        self._decisions_seen: dict[str, int] = {}
        self.held = Gauge("rlproxy_requests_held", "requests waiting at the gate", registry=self.registry)
        self.in_flight = Gauge("rlproxy_requests_in_flight", "requests inside the engine", registry=self.registry)
        self.late_calls = Counter(
            "rlproxy_untrainable_calls",
            "calls recorded after their group was claimed by a step or trained: served and kept, never trained",
            registry=self.registry,
        )
        # Shadow samples (gateway/shadow/): live calls shadowed and how it ended, the tokens the
        # shadows generated, the judge's calls on shadow groups.
        self.shadow_calls = Counter(
            "rlproxy_shadow_calls",
            "live calls given shadow samples, by outcome (shadowed, completed, failed, failed_judge: the group "
            "set aside after its last judgement, dropped_cap, dropped_stale, dropped_discarded; per task key on "
            "/v1/dashboard)",
            ["outcome"],
            registry=self.registry,
        )
        self.shadow_tokens = Counter(
            "rlproxy_shadow_tokens", "completion tokens generated for shadow samples", registry=self.registry
        )
        self.shadow_judge_calls = Counter(
            "rlproxy_shadow_judge_calls",
            "RULER judgements of shadow groups, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.shadow_in_flight = Gauge(
            "rlproxy_shadow_in_flight", "live calls being shadowed right now", registry=self.registry
        )
        # vLLM replicas (gateway/engines/vllm/replicas.py), by replica index.
        by_replica = {"labelnames": ["replica"], "registry": self.registry}
        self.replica_up = Gauge("rlproxy_vllm_replica_up", "1 while the replica serves", **by_replica)
        self.replica_in_flight = Gauge("rlproxy_vllm_replica_in_flight", "calls inside the replica", **by_replica)
        self.replica_calls = Counter("rlproxy_vllm_replica_calls", "calls the replica answered", **by_replica)
        self._replica_calls_seen: dict[str, int] = {}
        self.replica_step = Gauge("rlproxy_vllm_replica_step", "the step of NAME it serves (-1: none)", **by_replica)
        # `serve --trainer auto`'s child (gateway/trainer_process.py): one state at 1, the others at 0.
        self.trainer_state = Gauge(
            "rlproxy_trainer_state",
            "1 for the trainer child's state (running, restarting, stopped, failed: refused its settings, or "
            "crashed too often in a row)",
            ["state"],
            registry=self.registry,
        )
        self.trainer_restarts = Counter(
            "rlproxy_trainer_restarts",
            "times the trainer child was started again after it exited",
            registry=self.registry,
        )
        self._trainer_restarts_seen = 0
        self._request_counters: dict[tuple[str, bool], Counter] = {}  # `labels()` resolved once per pair

    def observe_call(self, status: str, stream: bool, latency_ms: float, untrainable: str | None = None) -> None:
        if untrainable is not None:
            self.late_calls.inc()
        counter = self._request_counters.get((status, stream))
        if counter is None:
            counter = self._request_counters[(status, stream)] = self.requests.labels(
                status=status, stream=str(stream).lower()
            )
        counter.inc()
        self.latency.observe(latency_ms / 1000.0)

    def observe_refused(self, error: Exception) -> None:
        """A protocol call's error response: counted here unless its call row counted it."""
        if not getattr(error, "recorded", False):
            self.refused.labels(status=str(getattr(error, "status_code", 500))).inc()

    def render(self, services, steps: tuple[int | None, int | None] | None = None, trainer=None) -> tuple[bytes, str]:
        """The text exposition; `steps`: the store's (serving, candidate) steps of NAME, read by the
        caller off the event loop (None: the store did not answer, the gauges keep their values);
        `trainer`: the `TrainerChild` of `serve --trainer auto`, if any."""
        commits = services.store.commits  # the store counts; the counter follows
        self.store_commits.inc(max(0, commits - self._commits_seen))
        self._commits_seen = max(commits, self._commits_seen)
        health = services.store.health
        for cause, count in list(health.errors.items()):  # the store counts; the counter follows
            self.store_errors.labels(cause=cause).inc(count - self._store_errors_seen.get(cause, 0))
            self._store_errors_seen[cause] = count
        self.store_degraded.set(1 if health.degraded else 0)
        current = services.registry.current
        self.model_step.set(-1 if current is None else current)
        shadows = services.extras.get("shadow")
        if shadows is not None:
            self.shadow_in_flight.set(shadows.in_flight)
        self._promotion(services, steps)
        self._replicas(services)
        if trainer is not None:
            self._trainer(trainer.status())
        self.held.set(services.gate.held)
        self.in_flight.set(services.gate.in_flight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _promotion(self, services, steps: tuple[int | None, int | None] | None) -> None:
        if steps is not None:
            serving, candidate = steps
            self.serving_step.set(-1 if serving is None else serving)
            self.candidate_step.set(-1 if candidate is None else candidate)
        canary = services.registry.canary
        for decision, count in (canary.decisions if canary is not None else {}).items():
            self.decisions.labels(decision=decision).inc(count - self._decisions_seen.get(decision, 0))
            self._decisions_seen[decision] = count

    def _replicas(self, services) -> None:
        for replica in services.engine.replica_states(services.settings.model_name, services.registry.current) or []:
            label = str(replica["replica"])
            self.replica_up.labels(replica=label).set(1 if replica["state"] == "ready" else 0)
            self.replica_in_flight.labels(replica=label).set(replica["in_flight"])
            self.replica_calls.labels(replica=label).inc(replica["calls"] - self._replica_calls_seen.get(label, 0))
            self._replica_calls_seen[label] = replica["calls"]
            self.replica_step.labels(replica=label).set(-1 if replica["step"] is None else replica["step"])

    def _trainer(self, status: dict) -> None:
        for state in ("running", "restarting", "failed", "stopped"):
            self.trainer_state.labels(state=state).set(1 if status["state"] == state else 0)
        self.trainer_restarts.inc(max(0, status["restarts"] - self._trainer_restarts_seen))
        self._trainer_restarts_seen = max(status["restarts"], self._trainer_restarts_seen)
