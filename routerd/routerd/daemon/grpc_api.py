"""routerd's gRPC API: ``phasewise.v1.RouterService`` and ``grpc.health.v1`` (grpc.aio).

For gateways that keep their own data path: ``Route`` asks for a decision on a
request's features and answers DISPATCH (instance and URL), HOLD (ask again after
``retry_after_s``) or REJECT (no endpoint, draining). A dispatched request stays in
routerd's in-flight bookkeeping until ``ReportCompletion`` names its ``request_id``, or
until ``grpc.report_timeout_s`` passes without one (counted in
``phasewise_grpc_unreported_total``), so a gateway that forgets to report cannot leak
load (vllm-project/router#179). ``Route`` is idempotent per in-flight ``request_id``; one
naming another model than the booked request's is refused (ALREADY_EXISTS).

Prefix-aware routing (``prefix.mode``) needs the prompt: a ``RouteRequest`` with ``prompt`` set is
hashed as a completions prompt string is (:mod:`routerd.daemon.prefix`); one that carries only
``prompt_tokens`` has no prefix identity (``RequestFeatures.prefix`` None), so the cache-aware
policies score it on load alone. (The message has no token-id field.)

Health: the overall status ("") and ``phasewise.v1.RouterService`` are SERVING while
``/readyz`` is ready, NOT_SERVING while draining or with no ready endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from routerd.api.v1 import router_pb2, router_pb2_grpc
from routerd.daemon.router import RejectedError, shown_name
from routerd.model import bucket_of
from routerd.tokens import count_text_tokens

if TYPE_CHECKING:
    from routerd.daemon.app import Daemon
    from routerd.daemon.state import Inflight

log = logging.getLogger("routerd.grpc")

SERVICE_NAME = "phasewise.v1.RouterService"
#: Longest list of model names quoted in a status message (characters; 8 KiB of metadata in all).
SHOWN_LIST_CHARS = 2000
#: ``ListDecisions`` default when the request's limit is 0.
DEFAULT_DECISIONS_LIMIT = 100
#: Held request ids remembered (for their router wait); the oldest are forgotten beyond this.
MAX_HELD = 10_000

RouteResponse = router_pb2.RouteResponse
CompletionReport = router_pb2.CompletionReport


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """The RouterService over one daemon's router."""

    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.inflight: dict[str, tuple["Inflight", float]] = {}
        """request_id -> (booked request, monotonic deadline for its report)."""
        self.held: dict[str, float] = {}
        """request_id -> monotonic time of its first Route that was held."""

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> RouteResponse:
        d = self.d
        router = d.router
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        model = request.model or None
        if model is not None:
            verdict = await d.settle_model(model)
            if verdict == "unknown":
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model {shown_name(model)} is not served")
            if verdict == "pending":
                # A list is still being read (a pod joining): retryable, as "no endpoint" is.
                return RouteResponse(request_id=rid, decision=RouteResponse.REJECT, reason="no_endpoint",
                                     policy=router.policy_name, predicted_bucket=-1)
        if model is None:
            if router.several_models:
                # Which endpoints may take it depends on its model: guessing one would misroute.
                listed = ", ".join(d.model_names())
                if len(listed) > SHOWN_LIST_CHARS:
                    listed = listed[:SHOWN_LIST_CHARS] + "…"  # hundreds of adapters: within the metadata limit
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required: this routerd serves "
                                    f"several models ({listed})")
            names = d.model_names()
            model = names[0] if names else None  # the one served model, or none known (any endpoint)
        booked = self.inflight.get(rid)
        if booked is not None:
            r = booked[0]
            if r.model != model:
                # Idempotence holds for the same request only: its endpoint may not serve this model.
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request_id {shown_name(rid)} is in flight for the model {shown_name(r.model)}; "
                                    f"this Route names the model {shown_name(model)}")
            return self._dispatched(rid, r)
        tokens = request.prompt_tokens
        if tokens == 0 and request.prompt:
            tokens = count_text_tokens(request.prompt)
        n_buckets = len(router.bucket_edges) + 1
        if request.HasField("predicted_bucket") and request.predicted_bucket >= 0:
            bucket: int | None = request.predicted_bucket
            if bucket >= n_buckets:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"predicted_bucket {bucket} is outside 0..{n_buckets - 1}")
        else:
            bucket = await d.predict(request.prompt or None, tokens, request.task or None, request.max_tokens)
        # The prefix comes from the prompt text when the gateway sends it; a request given by its
        # token count only has none (the cache-aware policies then score it on load alone).
        prefix = d.prefix_blocks(request.prompt) if request.prompt else None
        r = router.new_request(tokens, bucket, request.task or None, label=rid, model=model, prefix=prefix)
        first = self.held.get(rid)
        if first is not None:
            r.arrived_at = first
        try:
            ep = router.try_dispatch_now(r)
        except RejectedError as e:
            self.held.pop(rid, None)
            return RouteResponse(request_id=rid, decision=RouteResponse.REJECT, reason=e.reason,
                                 policy=router.policy_name, predicted_bucket=-1 if bucket is None else bucket)
        if ep is None:
            if first is None:
                if len(self.held) >= MAX_HELD:
                    self.held.pop(next(iter(self.held)))
                self.held[rid] = r.arrived_at
            return RouteResponse(request_id=rid, decision=RouteResponse.HOLD, retry_after_s=router.action_interval_s,
                                 reason="held by the policy", policy=router.policy_name,
                                 predicted_bucket=-1 if bucket is None else bucket)
        self.held.pop(rid, None)
        d.metrics.prompt_tokens.inc(tokens)
        self.inflight[rid] = (r, time.monotonic() + d.settings.grpc.report_timeout_s)
        return self._dispatched(rid, r)

    def _dispatched(self, rid: str, r: "Inflight") -> RouteResponse:
        ep = r.endpoint
        assert ep is not None
        return RouteResponse(request_id=rid, decision=RouteResponse.DISPATCH, instance=ep.name, endpoint=ep.url,
                             policy=self.d.router.policy_name, fallback=r.fallback,
                             predicted_bucket=-1 if r.predicted_bucket is None else r.predicted_bucket)

    async def ReportCompletion(self, request: CompletionReport,
                               context: grpc.aio.ServicerContext) -> router_pb2.CompletionAck:
        booked = self.inflight.pop(request.request_id, None)
        if booked is None:
            return router_pb2.CompletionAck(known=False)
        r = booked[0]
        d = self.d
        ep = r.endpoint
        n = request.generated_tokens
        if ep is not None and n:
            ep.on_first_token(r)
            ep.on_tokens(r, n)
        d.router.finish(r)
        if request.status == CompletionReport.OK:
            m = d.metrics
            if request.e2e_s > 0:
                m.e2e.observe(request.e2e_s)
            if request.ttft_s > 0:
                m.ttft.observe(request.ttft_s)
                if request.e2e_s > request.ttft_s and n > 1:
                    m.tpot.observe((request.e2e_s - request.ttft_s) / (n - 1))
            m.generation_tokens.inc(n)
            m.count_bucket(r.predicted_bucket, bucket_of(n, d.router.bucket_edges))
        return router_pb2.CompletionAck(known=True)

    async def GetState(self, request, context) -> router_pb2.RouterState:
        d = self.d
        router = d.router
        now = router.clock()
        max_age = d.settings.state.max_age_s
        eps = []
        for ep in router.endpoints:
            msg = router_pb2.EndpointState(instance=ep.name, endpoint=ep.url, ready=router.is_ready(ep, now),
                                           stale=ep.state_address is not None and ep.is_stale(now, max_age),
                                           in_flight=ep.in_flight)
            if ep.snapshot is not None:
                msg.instance_state.CopyFrom(ep.snapshot)
            eps.append(msg)
        return router_pb2.RouterState(policy=router.policy_name, queue_depth=len(router.queue),
                                      queue_limit=router.queue_limit, endpoints=eps,
                                      fallbacks_total=router.fallbacks_total)

    async def ListDecisions(self, request, context) -> router_pb2.ListDecisionsResponse:
        limit = request.limit or DEFAULT_DECISIONS_LIMIT
        out = []
        for rec in reversed(self.d.router.decisions):
            if len(out) >= limit:
                break
            label, at, instance, prompt_tokens, bucket, wait, policy, fallback = rec
            out.append(router_pb2.DecisionRecord(
                request_id=str(label), decided_at_unix_s=at, instance=instance, prompt_tokens=prompt_tokens,
                predicted_bucket=-1 if bucket is None else bucket, router_wait_s=wait, policy=policy,
                fallback=fallback))
        return router_pb2.ListDecisionsResponse(decisions=out)

    def expire(self, now: float) -> int:
        """Release gRPC-routed requests whose report is overdue; returns how many."""
        late = [rid for rid, (_, deadline) in self.inflight.items() if deadline <= now]
        for rid in late:
            r, _ = self.inflight.pop(rid)
            self.d.router.finish(r)
            self.d.metrics.grpc_unreported.inc()
        if late:
            log.warning("%d gRPC-routed requests were never reported; released after %g s", len(late),
                        self.d.settings.grpc.report_timeout_s)
        return len(late)

    def release_all(self) -> None:
        """Release every gRPC-routed request (shutdown)."""
        for r, _ in self.inflight.values():
            self.d.router.finish(r)
        self.inflight.clear()


class ReadinessHealth:
    """``grpc.health.v1`` statuses that follow routerd's readiness: ``services`` SERVING while it is
    ready, NOT_SERVING otherwise (routerd's gRPC API and the endpoint picker, :mod:`routerd.epp`).
    ``servicer`` is the HealthServicer to add to a server."""

    def __init__(self, services: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.services = tuple(services)
        self._serving: bool | None = None
        self._bg: set[asyncio.Future] = set()

    def set_serving(self, serving: bool) -> None:
        """Set every one of ``services`` to SERVING or NOT_SERVING, if that changed (in the
        background: the servicer's ``set`` is a coroutine, and callers are not)."""
        if serving == self._serving:
            return
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def _set() -> None:
            for name in self.services:
                await self.servicer.set(name, status)

        task = asyncio.ensure_future(_set())
        self._bg.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._bg.discard)


async def cancel_task(task: "asyncio.Task | None") -> None:
    """Cancel ``task`` (None: nothing) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class GrpcServer:
    """The grpc.aio server of one daemon."""

    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.servicer = RouterServicer(daemon)
        self.readiness = ReadinessHealth(("", SERVICE_NAME))
        self.health = self.readiness.servicer
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind ``host:port`` (0 = any free port, see :attr:`port`) and start serving.

        Raises:
            routerd.errors.ConfigError: the address cannot be bound.
        """
        from routerd.errors import ConfigError

        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(addr)
        except RuntimeError as e:
            raise ConfigError(f"grpc: cannot listen on {addr}: {e}") from None
        await self.server.start()
        self._sweeper = asyncio.create_task(self._sweep())

    def set_serving(self, serving: bool) -> None:
        """Set the health status of the server and the RouterService."""
        self.readiness.set_serving(serving)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.d.settings.grpc.report_timeout_s / 4))
            self.servicer.expire(time.monotonic())
            # Readiness also changes with time (a connect-failure cooldown running out).
            self.set_serving(self.d.readiness()[0])

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving (in-flight RPCs get ``grace_s``) and release gRPC-routed bookkeeping."""
        await cancel_task(self._sweeper)
        self._sweeper = None
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)
            self.server = None
        self.servicer.release_all()
