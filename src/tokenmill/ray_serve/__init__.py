"""tokenmill on Ray Serve: an ingress deployment with the OpenAI + TGI routes over N engine
replicas, prefix-affinity routing, autoscaling and replica recovery.

    from ray import serve
    from tokenmill.ray_serve import build_app, ReplicaOptions
    serve.run(build_app({"model": "path/to/model"}, ReplicaOptions(num_replicas=2)), name="tokenmill")

Needs the `ray` extra: pip install "tokenmill[ray]".
"""

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('tokenmill.ray_serve needs Ray Serve: pip install "tokenmill[ray]"') from e

from tokenmill.ray_serve.app import (  # noqa: E402
    APP_NAME,
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    ClusterOptions,
    ReplicaOptions,
    app_builder,
    build_app,
    run_cli,
)
from tokenmill.ray_serve.ingress import IngressOptions  # noqa: E402
from tokenmill.ray_serve.routing import POLICIES, TokenmillRouter  # noqa: E402

__all__ = [
    "APP_NAME",
    "ENGINE_DEPLOYMENT",
    "INGRESS_DEPLOYMENT",
    "POLICIES",
    "ClusterOptions",
    "IngressOptions",
    "ReplicaOptions",
    "TokenmillRouter",
    "app_builder",
    "build_app",
    "run_cli",
]
