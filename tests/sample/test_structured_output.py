"""Structured output (llguidance) through the server with the official `openai` smollm2_client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import wait_engine_idle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def url(smollm2_server):
    return smollm2_server.url


def test_json_schema_always_parses(smollm2_client, smollm2_model):
    r = smollm2_client.chat.completions.create(
        model=smollm2_model,
        messages=ASK,
        n=4,
        temperature=1.0,
        seed=0,
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    for choice in r.choices:
        obj = json.loads(choice.message.content)
        assert set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str)
        assert isinstance(obj["age"], int) and all(isinstance(t, str) for t in obj["tags"])
        assert choice.finish_reason == "stop"


def test_json_object_and_vllm_guided_json(smollm2_client, smollm2_model):
    # Only a finished object must parse, and SmolLM2 can repeat keys past any max_tokens: sampled
    # (seed 1 at 0.7) on one CPU, greedy on "Describe a person" once bf16 sums ran on AMX. This
    # prompt closes greedily in 25-31 tokens with AVX2, AVX512-BF16 and AMX sums alike.
    ask = [{"role": "user", "content": "Reply with a JSON object for a person: name and age only."}]
    r = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=ask, temperature=0, max_tokens=300, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = smollm2_client.completions.create(
        model=smollm2_model,
        prompt="A person:",
        max_tokens=200,
        temperature=0.7,
        seed=2,
        extra_body={"guided_json": SCHEMA},
    )
    assert set(json.loads(c.choices[0].text)) == {"name", "age", "tags"}


def test_regex_choice_and_grammar(smollm2_client, smollm2_model, url):
    r = smollm2_client.completions.create(
        model=smollm2_model,
        prompt="Call me at",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    stream = smollm2_client.chat.completions.create(
        model=smollm2_model,
        stream=True,
        max_tokens=10,
        messages=[{"role": "user", "content": "Sentiment of: I love it!"}],
        extra_body={"guided_choice": choices},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) in choices
    lark = smollm2_client.completions.create(
        model=smollm2_model,
        prompt="Answer:",
        max_tokens=10,
        temperature=1.0,
        seed=4,
        extra_body={"guided_grammar": 'start: "yes" | "no"'},
    )
    assert lark.choices[0].text in ("yes", "no")
    gbnf = smollm2_client.completions.create(
        model=smollm2_model,
        prompt="Count:",
        max_tokens=10,
        temperature=1.0,
        seed=5,
        extra_body={"guided_grammar": 'root ::= ("one" | "two") " " ("cat" | "dog")'},
    )
    assert re.fullmatch("(one|two) (cat|dog)", gbnf.choices[0].text)
    # TGI's grammar parameter.
    small = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    t = httpx.post(
        url + "/generate",
        timeout=120,
        json={
            "inputs": "A person as JSON:",
            "parameters": {"max_new_tokens": 100, "grammar": {"type": "json", "value": small}},
        },
    )
    assert t.status_code == 200, t.text
    assert set(json.loads(t.json()["generated_text"])) == {"name", "age"}
    bad = httpx.post(url + "/generate", timeout=30, json={"inputs": "x", "parameters": {"grammar": {"type": "xml"}}})
    assert bad.status_code == 422


def test_bad_grammar_is_a_400(smollm2_client, smollm2_model):
    with pytest.raises(openai.BadRequestError, match="grammar"):
        smollm2_client.completions.create(
            model=smollm2_model, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"}
        )


# Compiles, but llguidance builds its lexer lazily and runs out of budget a few tokens in: it used to
# answer 200 with an empty output (finish "stop") that does not match, and only the log said why.
BOMB = "((a{1,1000}){1,1000}){1,1000}"
BOMB_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{BOMB}$"}}, "required": ["s"]}
WHY = "too many expressions constructed"


def test_a_grammar_that_cannot_be_followed_is_a_400_in_every_api(smollm2_server):
    client, model, url = smollm2_server.client, smollm2_server.model, smollm2_server.url

    def complete(**extra):
        return client.completions.create(model=model, prompt="Say a", max_tokens=20, extra_body=extra)

    openai_calls = [
        lambda: complete(guided_regex=BOMB),
        lambda: complete(guided_json=BOMB_SCHEMA),
        lambda: complete(guided_grammar=f"start: /{BOMB}/"),
        lambda: client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": BOMB_SCHEMA}},
        ),
        lambda: client.chat.completions.create(
            model=model, messages=ASK, max_tokens=20, stream=True, extra_body={"guided_regex": BOMB}
        ),
    ]
    for call in openai_calls:
        with pytest.raises(openai.BadRequestError, match=WHY) as e:
            call()
        assert e.value.status_code == 400 and e.value.body["message"].startswith("invalid guided decoding grammar")
    anth = httpx.post(
        url + "/v1/messages",
        timeout=60,
        json={
            "model": model,
            "max_tokens": 20,
            "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": BOMB_SCHEMA}},
        },
    )
    assert anth.status_code == 400 and anth.json()["type"] == "error", anth.text
    assert WHY in anth.json()["error"]["message"] and anth.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(
        url + "/v1/responses",
        timeout=60,
        json={
            "model": model,
            "input": "x",
            "max_output_tokens": 20,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": BOMB_SCHEMA}},
        },
    )
    assert resp.status_code == 400 and WHY in resp.json()["error"]["message"], resp.text
    tgi = httpx.post(
        url + "/generate",
        timeout=60,
        json={"inputs": "x", "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": BOMB}}},
    )
    assert tgi.status_code == 422 and WHY in tgi.json()["error"], tgi.text
    assert wait_engine_idle(smollm2_server.aengine)  # nothing was queued, no KV block held
    ok = client.completions.create(
        model=model, prompt="Call me at", max_tokens=20, temperature=0, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", ok.choices[0].text)


def test_grammar_masks_match_the_matchers_bitmasks(tiny_llama_llm):
    """The eager masking (not llguidance's torch.compile'd one) keeps exactly each matcher's tokens."""
    import numpy as np
    import torch

    from tokenmill.sample.structured_output import apply_grammar_masks
    from tokenmill.sampling_params import GuidedDecodingParams

    so = tiny_llama_llm.engine.structured_output
    matchers = [
        so.matcher_for(GuidedDecodingParams(regex="[ab]+c")),
        None,
        so.matcher_for(GuidedDecodingParams(choice=["hello", "world"])),
    ]
    logits = torch.randn(3, so.vocab_size)
    masked = logits.clone()
    apply_grammar_masks(masked, matchers)
    assert torch.equal(masked[1], logits[1])
    for row in (0, 2):
        bits = np.unpackbits(np.frombuffer(matchers[row].compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: so.vocab_size].astype(bool))
        assert 0 < int(allowed.sum()) < so.vocab_size
        assert torch.equal(masked[row][allowed], logits[row][allowed])
        assert torch.isneginf(masked[row][~allowed]).all()
