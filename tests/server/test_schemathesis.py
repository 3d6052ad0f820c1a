"""Property-based tests of the whole HTTP API with schemathesis: a real server (uvicorn on a
free loopback port over the tiny Llama), its own /openapi.json, and for every operation
generated requests, valid ones and deliberately invalid ones (wrong types, out-of-range values,
malformed bodies), each checked for: no 5xx, a status code the schema documents, the documented
content type, and a body (SSE events included) that follows the documented schema.

Deterministic: hypothesis derandomized, no example database, so every run sends the same
requests. The context is 64 tokens, so even the largest request the schema allows (128
samples of up to 63 tokens) stays cheap on the tiny model; the run ends with a check that
at least MIN_CASES requests were made in all, and prints (with -s) how many per operation were
answered with a 2xx. About 2,300 requests, 30-70 s on 2 cores.
"""

from __future__ import annotations

import collections
import time

import pytest
import requests
import schemathesis
from conftest import running_server
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow  # over 2,000 requests
MAX_MODEL_LEN = 64
MAX_NEW_TOKENS = 24
MIN_CASES = 2000
EXAMPLES_PER_OPERATION = 80  # fuzzing phase; the coverage and examples phases add their own cases
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
CASES: collections.Counter = collections.Counter()  # requests sent, per operation
SECONDS: collections.Counter = collections.Counter()  # and the time they took
ANSWERED: collections.Counter = collections.Counter()  # and how many were 2xx (the rest refused)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_model_len=MAX_MODEL_LEN) as (server, aengine):
        yield server, aengine


@pytest.fixture(scope="module")
def api(served):
    server, aengine = served
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    _aim(spec, aengine.engine.config.model.name)
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=server.url)
    return schema


def _aim(spec: dict, model: str) -> None:
    """Point the generated valid requests at what this server can answer with a 200, so that
    generation is exercised too, not only validation: `model` is the served name (any other is a
    404) and new tokens are at most MAX_NEW_TOKENS (63 would fill the context). This narrows what
    is generated as valid, in the test's copy of the schema; every check stays as it is."""
    for name, sch in spec["components"]["schemas"].items():
        props = sch.get("properties", {})
        if name.endswith("Request") and "model" in props:
            props["model"] = {"anyOf": [{"const": model}, {"type": "null"}]}
        for field in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            for arm in props.get(field, {}).get("anyOf", []):
                if arm.get("type") == "integer":
                    arm["maximum"] = MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
def test_api(case, session):
    CASES[case.operation.label] += 1
    t0 = time.perf_counter()
    response = case.call(session=session, timeout=60)
    SECONDS[case.operation.label] += time.perf_counter() - t0
    ANSWERED[case.operation.label] += response.status_code < 300
    case.validate_response(response, checks=CHECKS)


def test_case_count_and_engine_clean(served, api):
    """After the run: enough requests in all, every operation exercised, and the engine idle with
    every KV block back (no request leaked by an error path)."""
    operations = {op.ok().label for op in api.get_all_operations()}
    if set(CASES) != operations:
        pytest.skip(f"only part of the run was selected ({len(CASES)} of {len(operations)} operations)")
    total = sum(CASES.values())
    print(f"\nschemathesis: {total} requests over {len(CASES)} operations in {sum(SECONDS.values()):.1f} s")
    for label, n in CASES.most_common():
        print(f"  {label}: {n} requests ({ANSWERED[label]} answered 2xx), {SECONDS[label]:.1f} s")
    assert total >= MIN_CASES, dict(CASES)
    aengine = served[1]
    kv, sched = aengine.engine.core.kv, aengine.engine.core.scheduler
    deadline = time.monotonic() + 30  # an aborted stream's blocks come back on the engine's next step
    while (sched.requests or kv.num_free_blocks != kv.num_usable_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aengine.is_running and not sched.requests and kv.num_free_blocks == kv.num_usable_blocks
