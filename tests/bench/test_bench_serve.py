"""`tokenmill bench serve` against the real server on the tiny model, in-process."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import running_server

from tokenmill.bench.datasets import load_tokenizer, prefix_requests, random_requests, sharegpt_requests
from tokenmill.bench.serve import benchmark, format_report, parse_goodput
from tokenmill.cli import build_parser


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    with running_server(tiny_llama_dir) as (server, _):
        yield server.url


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def _check(result, n, out_len=8):
    m = result["metrics"]
    assert m["failed"] == 0 and m["completed"] == n, [r["error"] for r in result["requests"]]
    assert all(r["success"] and r["output_tokens"] == out_len for r in result["requests"])
    assert m["total_output_tokens"] == n * out_len
    for k in ("request_throughput", "output_throughput", "duration_s"):
        assert m[k] > 0
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(m[k]) >= {"mean", "median", "p90", "p99"}
        assert m[k]["mean"] > 0 and m[k]["p99"] >= m[k]["median"] > 0
    assert all(len(r["itl"]) >= 1 for r in result["requests"])
    assert "Serving Benchmark Result" in format_report(m)


def test_random_max_concurrency(url, tok, tmp_path):
    reqs = random_requests(tok, 8, 16, 8, seed=0)
    assert len(reqs) == 8 and all(r.output_len == 8 and r.prompt_len > 0 for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in random_requests(tok, 8, 16, 8, seed=0)]  # seeded
    result = asyncio.run(
        benchmark(url, reqs, max_concurrency=4, disable_tqdm=True, goodput=parse_goodput(["ttft:60000", "tpot:60000"]))
    )
    _check(result, 8)
    assert result["metrics"]["request_goodput"] == pytest.approx(result["metrics"]["request_throughput"])
    path = tmp_path / "res.json"
    path.write_text(json.dumps(result))
    assert json.loads(path.read_text())["metrics"]["completed"] == 8


def test_prefix_chat_poisson(url, tok):
    reqs = prefix_requests(tok, 6, 32, 8, 8, seed=1)
    prefix = reqs[0].prompt[:20]
    assert all(r.prompt.startswith(prefix) for r in reqs)
    result = asyncio.run(
        benchmark(url, reqs, request_rate=50.0, burstiness=0.5, disable_tqdm=True, endpoint="/v1/chat/completions")
    )
    _check(result, 6)
    pc = result["metrics"]["prefix_cache"]  # scraped from the server's /metrics around the run
    assert pc["queries"] >= sum(r.prompt_len for r in reqs) and pc["hits"] > 0 and 0 < pc["hit_rate"] < 1


def test_range_ratio_and_sharegpt(tok, tmp_path):
    reqs = random_requests(tok, 50, 20, 10, range_ratio=0.5, seed=3)
    assert {r.output_len for r in reqs} <= set(range(5, 16)) and len({r.output_len for r in reqs}) > 1
    conv = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about paged attention please " * 2},
                {"from": "gpt", "value": "It keeps the KV cache in fixed-size blocks " * 2},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "no human turn first"}]},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(conv))
    sg = sharegpt_requests(tok, str(p), 10)
    assert len(sg) == 1 and sg[0].prompt.startswith("Tell me")
    assert sg[0].output_len == len(tok.encode(conv[0]["conversations"][1]["value"], add_special_tokens=False))


def test_cli_end_to_end(url, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    ns = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            url,
            "--tokenizer",
            tiny_llama_dir,
            "--num-prompts",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--max-concurrency",
            "2",
            "--goodput",
            "ttft:60000",
            "tpot:60000",
            "--disable-tqdm",
            "--result-file",
            str(out),
            "--plot",
        ]
    )
    assert ns.func(ns) == 0
    data = json.loads(out.read_text())
    assert data["metrics"]["completed"] == 4 and data["metrics"]["total_output_tokens"] == 32
    assert "Request goodput" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cmd, expect",
    [
        (["throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "4"], "output_tokens_per_s"),
        (["latency", "--num-iters", "2", "--input-len", "8", "--output-len", "4"], "tpot_s"),
        (
            ["roofline", "--num-iters", "1", "--input-len", "8", "--output-len", "4", "--prefill-len", "64"],
            "batch1_decode_fraction_of_bandwidth",
        ),
    ],
)
def test_offline_bench_commands(cmd, expect, tiny_llama_dir, tmp_path):
    from tokenmill.cli import main

    out = tmp_path / "r.json"
    args = [
        "bench",
        *cmd,
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "0.02",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res[expect] > 0
