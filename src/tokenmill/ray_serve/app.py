"""Building the Ray Serve application (`build_app`, `app_builder` for `serve run` / `serve deploy`)
and running it from `tokenmill serve --num-replicas N` (`run_cli`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from tokenmill.config import EngineArgs
from tokenmill.model.loader import resolve_model_path
from tokenmill.ray_serve.ingress import TokenmillIngress
from tokenmill.ray_serve.replica import EngineReplica
from tokenmill.ray_serve.routing import POLICIES, TokenmillRouter
from tokenmill.server.args import RAY_INGRESS_FIELDS, ServerArgs

logger = logging.getLogger("tokenmill.ray_serve")

APP_NAME = "tokenmill"
INGRESS_DEPLOYMENT = "TokenmillIngress"
ENGINE_DEPLOYMENT = "TokenmillEngine"
INGRESS_MAX_ONGOING = 4096  # the ingress only forwards: it must not be what queues requests (Serve's default is 5)


@dataclass
class ReplicaOptions:
    """How many engine replicas, how they scale, route and what each reserves."""

    num_replicas: int = 1  # fixed count; with min/max_replicas, the autoscaler's initial count
    min_replicas: int | None = None  # either of these turns on autoscaling on ongoing requests
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # per replica, what the autoscaler aims for
    routing: str = "prefix"  # prefix | round_robin | pow2 (see routing.py)
    max_ongoing_requests: int | None = None  # per replica; default: the engine's max_num_seqs
    max_waiting: int | None = None  # the engine's --max-waiting (503 + Retry-After beyond it)
    imbalance_threshold: int = 8  # prefix routing: most extra ongoing requests affinity may cost
    drain_timeout: float = 30.0  # seconds a stopping replica lets its requests finish (Serve's graceful shutdown)
    # More of Serve's autoscaling_config when autoscaling (upscale_delay_s, downscale_delay_s, look_back_period_s, ...)
    extra_autoscaling_config: dict = field(default_factory=dict)

    def check(self) -> None:
        if self.routing not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if self.min_replicas is not None and self.min_replicas < 1:
            raise ValueError(
                f"--min-replicas must be >= 1 (the ingress needs a replica to learn the model), got {self.min_replicas}"
            )
        if self.autoscaling and self.bounds[0] > self.bounds[1]:
            raise ValueError(f"--min-replicas ({self.bounds[0]}) is above --max-replicas ({self.bounds[1]})")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.num_replicas)
        return lo, hi

    @property
    def most_replicas(self) -> int:
        return self.bounds[1] if self.autoscaling else self.num_replicas


def replica_resources(engine: EngineArgs) -> dict[str, Any]:
    """Serve options reserving a replica's CPUs: num_threads per tensor-parallel rank (1 if unset).
    With TP the ranks' processes are the engine's own children, so they must share a node: one
    bundle per rank in a STRICT_PACK placement group, the replica actor in the first."""
    threads = engine.num_threads or 1
    tp = engine.tensor_parallel_size
    if tp <= 1:
        return {"ray_actor_options": {"num_cpus": threads}}
    return {
        "ray_actor_options": {"num_cpus": threads},
        "placement_group_bundles": [{"CPU": threads}] * tp,
        "placement_group_strategy": "STRICT_PACK",
    }


def build_app(
    engine: EngineArgs | dict | None = None,
    replicas: ReplicaOptions | None = None,
    server: ServerArgs | None = None,
    replica_setup: Callable[[Any], None] | None = None,
) -> serve.Application:
    """The tokenmill app as a Serve application: an ingress deployment (the OpenAI + TGI routes)
    over `replicas.num_replicas` engine replicas. `engine`: EngineArgs (or its fields as a dict);
    `server`: the ServerArgs of `tokenmill serve`, whose RAY_INGRESS_FIELDS the ingress reads;
    `replica_setup(aengine)` runs in each replica once its engine is built.
    Run it with `serve.run(build_app(...), name="tokenmill", route_prefix="/")`."""
    args = engine if isinstance(engine, EngineArgs) else EngineArgs(**(engine or {}))
    replicas = replicas or ReplicaOptions()
    replicas.check()
    server = server or ServerArgs()
    scaling: dict[str, Any]
    if replicas.autoscaling:
        lo, hi = replicas.bounds
        scaling = {
            "autoscaling_config": {
                "min_replicas": lo,
                "max_replicas": hi,
                "initial_replicas": min(max(replicas.num_replicas, lo), hi),
                "target_ongoing_requests": replicas.target_ongoing_requests,
                **replicas.extra_autoscaling_config,
            }
        }
    else:
        scaling = {"num_replicas": replicas.num_replicas}
    router = RequestRouterConfig(
        request_router_class=TokenmillRouter,
        request_router_kwargs={
            "policy": replicas.routing,
            "block_size": args.block_size,
            "imbalance_threshold": replicas.imbalance_threshold,
        },
    )
    engine_deployment = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        max_ongoing_requests=replicas.max_ongoing_requests or args.max_num_seqs,
        request_router_config=router,
        health_check_period_s=5.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=replicas.drain_timeout,
        **replica_resources(args),
        **scaling,
    )
    ingress = serve.deployment(TokenmillIngress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=replicas.drain_timeout,
    )
    return ingress.bind(engine_deployment.bind(asdict(args), replicas.max_waiting, replica_setup), server)


# app_builder's keys of the ingress's former options (IngressOptions), as ServerArgs fields.
_FORMER_KEYS = {"log_requests": "disable_log_requests", "enable_web_ui": "disable_web_ui"}


def app_builder(args: dict) -> serve.Application:
    """For a Serve config file (`import_path: tokenmill.ray_serve:app_builder`): `args` holds any
    EngineArgs field (model, dtype, num_threads, ...), ReplicaOptions field (num_replicas,
    routing, ...) and ServerArgs field the ingress reads (server.args.RAY_INGRESS_FIELDS: api_key,
    ...; log_requests and enable_web_ui as before, the opposites of disable_log_requests and
    disable_web_ui). Unknown keys are refused."""
    groups: dict[str, dict] = {"engine": {}, "replicas": {}, "server": {}}
    owners = {
        "engine": {f.name for f in fields(EngineArgs)},
        "replicas": {f.name for f in fields(ReplicaOptions)},
        "server": set(RAY_INGRESS_FIELDS),
    }
    for key, value in (args or {}).items():
        if key in _FORMER_KEYS:
            key, value = _FORMER_KEYS[key], not value
        owner = next((group for group, names in owners.items() if key in names), None)
        if owner is None:
            known = sorted({*(n for names in owners.values() for n in names), *_FORMER_KEYS})
            raise ValueError(f"unknown tokenmill application argument {key!r}; known: {', '.join(known)}")
        groups[owner][key] = value
    return build_app(
        EngineArgs(**groups["engine"]), ReplicaOptions(**groups["replicas"]), ServerArgs(**groups["server"])
    )


@dataclass
class ClusterOptions:
    """Where the app runs: `ray_address` None starts a local Ray on 127.0.0.1."""

    ray_address: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    keep_alive_timeout_s: int = 5
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str = ""


def local_cpus() -> int:
    """CPUs this process may use (affinity), what a local Ray is given."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def start_ray(ray_address: str | None) -> None:
    if ray_address:
        logger.info("joining the Ray cluster at %s", ray_address)
        ray.init(address=ray_address)
    else:
        logger.info("starting a local Ray on 127.0.0.1 with %d CPUs (no dashboard)", local_cpus())
        ray.init(num_cpus=local_cpus(), include_dashboard=False, _node_ip_address="127.0.0.1")


def run_cli(engine: EngineArgs, replicas: ReplicaOptions, server: ServerArgs, cluster: ClusterOptions) -> int:
    """`tokenmill serve --num-replicas N`: deploy on Ray Serve, serve until SIGTERM / SIGINT, then
    delete the app (Serve drains the replicas) and stop Ray if we started it."""
    replicas.check()
    if engine.num_threads is None and not cluster.ray_address:
        # Share this machine's cores out among the replicas' ranks instead of each taking them all.
        engine.num_threads = max(1, local_cpus() // (replicas.most_replicas * engine.tensor_parallel_size))
        logger.info(
            "--num-threads not given: %d per replica rank (%d CPUs, up to %d replicas x TP %d)",
            engine.num_threads,
            local_cpus(),
            replicas.most_replicas,
            engine.tensor_parallel_size,
        )
    app = build_app(engine, replicas, server)
    if not cluster.ray_address:
        # Here, once: a bad path fails now with its message (not after Serve's constructor retries),
        # and the replicas do not both convert the same GGUF file at once.
        resolve_model_path(engine.model)
    start_ray(cluster.ray_address)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        http = {
            "host": cluster.host,
            "port": cluster.port,
            "keep_alive_timeout_s": cluster.keep_alive_timeout_s,
            "root_path": cluster.root_path,
        }
        if cluster.ssl_certfile:
            http.update(ssl_keyfile=cluster.ssl_keyfile, ssl_certfile=cluster.ssl_certfile)
        serve.start(http_options=http)
        t0 = time.perf_counter()
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # DEPLOY_FAILED: a replica's constructor kept raising
            logger.error("%s (each replica's log: /tmp/ray/session_latest/logs/serve/)", e)
            return 1
        scheme = "https" if cluster.ssl_certfile else "http"
        logger.info(
            "tokenmill is serving on %s://%s:%d through Ray Serve (%s) in %.0f s; Ctrl-C (SIGINT) or SIGTERM to stop",
            scheme,
            cluster.host,
            cluster.port,
            _replica_summary(replicas),
            time.perf_counter() - t0,
        )
        while not stop.wait(1.0):
            pass
        logger.info("stopping: deleting the app (in-flight requests get up to %g s)", replicas.drain_timeout)
        serve.delete(APP_NAME)
        if not cluster.ray_address:
            serve.shutdown()
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        ray.shutdown()


def _replica_summary(r: ReplicaOptions) -> str:
    if r.autoscaling:
        lo, hi = r.bounds
        return f"{lo}-{hi} engine replicas, autoscaled at {r.target_ongoing_requests:g} ongoing requests each"
    return f"{r.num_replicas} engine replica{'s' if r.num_replicas > 1 else ''}, {r.routing} routing"
