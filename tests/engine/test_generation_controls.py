"""logit_bias, bad_words and watermarking, through the server with the official `openai` smollm2_client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tokenmill.cli import main
from tokenmill.config import WatermarkConfig
from tokenmill.sample.watermark import detect, detect_text, greenlist

QUESTION = [{"role": "user", "content": "Tell me about the history of the Roman empire."}]


@pytest.fixture(scope="module")
def url(smollm2_server):
    return smollm2_server.url


@pytest.fixture(scope="module")
def tok(smollm2_server):
    return smollm2_server.aengine.engine.tokenizer


def test_logit_bias(smollm2_client, smollm2_model, tok):
    rome = tok.encode(" Rome", add_special_tokens=False)[0]
    r = smollm2_client.completions.create(
        model=smollm2_model,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logit_bias={str(rome): 100},
        logprobs=0,
    )
    assert r.choices[0].logprobs.tokens == [" Rome"] * 6
    plain = smollm2_client.chat.completions.create(model=smollm2_model, messages=QUESTION, max_tokens=3, temperature=0)
    first = tok.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    banned = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=QUESTION, max_tokens=3, temperature=0, logit_bias={str(first): -100}
    )
    assert tok.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first
    for bias, msg in (({"abc": 1}, "token ids"), ({"99999999": 1}, "token ids"), ({str(rome): 250}, "-100, 100")):
        with pytest.raises(openai.BadRequestError, match=msg):
            smollm2_client.completions.create(model=smollm2_model, prompt="Hi", max_tokens=2, logit_bias=bias)


def _contains(pieces: list[bytes], seq: list[bytes]) -> bool:
    return any(pieces[i : i + len(seq)] == seq for i in range(len(pieces) - len(seq) + 1))


def test_bad_words(smollm2_client, smollm2_model, tok):
    """vLLM's rule: each bad word's token sequence, alone and after a space, is never generated
    (another tokenization of the same letters, e.g. " Rom" + "ans", is not banned)."""
    words = ["Roman", "empire", "Empire"]
    banned = [
        [tok.decode([i]).encode() for i in tok.encode(t, add_special_tokens=False)] for w in words for t in (w, " " + w)
    ]

    def answer(**extra):
        r = smollm2_client.chat.completions.create(
            model=smollm2_model,
            messages=QUESTION,
            max_tokens=40,
            temperature=0,
            logprobs=True,
            extra_body=extra or None,
        )
        return r.choices[0].message.content, [bytes(c.bytes) for c in r.choices[0].logprobs.content]

    text, pieces = answer()
    assert b"".join(pieces).decode() == text and any(_contains(pieces, seq) for seq in banned)
    text, pieces = answer(bad_words=words)
    assert text and not any(_contains(pieces, seq) for seq in banned), (text, pieces)


def _story(smollm2_client, smollm2_model, watermark: bool) -> str:
    r = smollm2_client.chat.completions.create(
        model=smollm2_model,
        messages=[{"role": "user", "content": "Write a long story about a dragon who bakes bread."}],
        max_tokens=200,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True, "watermark": watermark},
    )
    assert r.usage.completion_tokens == 200
    return r.choices[0].message.content


def test_watermark_detected_only_when_on(smollm2_client, smollm2_model, smollm2_dir, capsys):
    marked, plain = _story(smollm2_client, smollm2_model, True), _story(smollm2_client, smollm2_model, False)
    z_marked = detect_text(marked, smollm2_dir).z_score
    z_plain = detect_text(plain, smollm2_dir).z_score
    assert z_marked > 4 and z_plain < 2, (z_marked, z_plain)
    assert main(["watermark", "detect", "--model", smollm2_dir, marked]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["watermarked"] is True and out["z_score"] > 4 and out["num_tokens_scored"] > 150


def test_watermark_tgi_parameter(url, smollm2_dir):
    body = {
        "inputs": "The history of bread begins",
        "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": 1, "watermark": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert detect_text(r.json()["generated_text"], smollm2_dir).z_score > 4


def test_detector_statistics():
    V, cfg = 1000, WatermarkConfig()
    assert len(greenlist(7, V, cfg.gamma)) == 500
    assert not set(greenlist(7, V, 0.25).tolist()) - set(greenlist(7, V, 0.5).tolist())  # same permutation
    # A sequence that always picks a green token scores z = sqrt(T); a random one scores near 0.
    seq = [1]
    for _ in range(100):
        seq.append(int(greenlist(seq[-1], V, 0.5)[0]))
    s = detect(seq, V)
    assert s.num_green_tokens == 100 and s.z_score == pytest.approx(10.0)
    import random

    rng = random.Random(0)
    assert abs(detect([rng.randrange(V) for _ in range(400)], V).z_score) < 4
    with pytest.raises(ValueError):
        WatermarkConfig(gamma=1.5)
