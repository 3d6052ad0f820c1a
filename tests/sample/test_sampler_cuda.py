"""The sampler on CUDA logits: the scenario of sampler_scenario.py compared with its CPU results
(sampler_golden.json). Sampled rows draw other noise on CUDA (other generators), so they are
checked by their invariants: reproducible with a seed whatever the batch, inside the grammar."""

from __future__ import annotations

import warnings

import pytest
import torch
from sampler_scenario import GRAMMARS, STEPS, FakeMatcher, V, assert_same, load_golden, make_requests, run, step_logits

from tokenmill.sample.sampler import Sampler, SamplingBatch
from tokenmill.sample.structured_output import apply_grammar_masks
from tokenmill.sampling_params import GuidedDecodingParams

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)
GREEDY_ROWS = [0, 1, 5, 7]  # their history is their own greedy tokens: the same as on CPU
SEEDED_ROWS = [2, 3, 6, 8, 9]
LOGPROB_ROWS = {0: 3, 1: 0, 2: 2, 6: 1, 7: 2}  # row: top N


@pytest.fixture(scope="module")
def cuda_run() -> dict:
    return run("cuda")


def test_greedy_rows_and_scores_match_cpu(cuda_run):
    gold = load_golden()
    for step in range(STEPS):
        assert [cuda_run["tokens"][step][r] for r in GREEDY_ROWS] == [gold["tokens"][step][r] for r in GREEDY_ROWS]
    assert_same(cuda_run["greedy"], gold["greedy"], tol=1e-4)
    assert_same(cuda_run["scores"], gold["scores"], tol=1e-4)
    # Processed logits: every row at step 0 (same history everywhere), the greedy rows after.
    assert_same(cuda_run["processed"][0], gold["processed"][0], tol=1e-3)
    for step in range(1, STEPS):
        assert_same(
            [cuda_run["processed"][step][r] for r in GREEDY_ROWS],
            [gold["processed"][step][r] for r in GREEDY_ROWS],
            tol=1e-3,
        )


def test_logprobs_match_cpu(cuda_run):
    """Every row's logprobs: the raw distribution's top N as on CPU, the sampled token's logprob
    and rank as CPU computes them for the token CUDA picked."""
    gold = load_golden()
    for step in range(STEPS):
        ref = torch.log_softmax(step_logits(step), dim=-1)
        for row in range(10):
            got = cuda_run["logprobs"][step][row]
            if row not in LOGPROB_ROWS:
                assert got is None
                continue
            tok = cuda_run["tokens"][step][row]
            lp, rank, top = got
            assert abs(lp - ref[row, tok].item()) < 1e-4
            assert rank == int((ref[row] > ref[row, tok]).sum()) + 1
            assert len(top) == LOGPROB_ROWS[row]
            assert_same(top, gold["logprobs"][step][row][2], tol=1e-4)


def test_grammar_rows_pick_allowed_tokens(cuda_run):
    for step in range(STEPS):
        for row, allowed in GRAMMARS.items():
            assert cuda_run["tokens"][step][row] in allowed


def test_seeded_rows_reproducible_across_batches():
    full = run("cuda")
    assert run("cuda")["tokens"] == full["tokens"]  # and the same again (fresh seeds, fresh sampler)
    sub = run("cuda", rows=SEEDED_ROWS)
    alone = run("cuda", rows=[6])
    for step in range(STEPS):
        assert sub["tokens"][step] == [full["tokens"][step][r] for r in SEEDED_ROWS]
        assert alone["tokens"][step] == [full["tokens"][step][6]]


def test_processed_logits_match_cpu_along_the_cpu_history():
    """Penalties, bias, watermark, bans and grammar on CUDA equal CPU's at every step, with both
    batches following the CPU run's tokens (so output counts and bans build up)."""
    gold = load_golden()
    reqs = make_requests()
    sampler = Sampler()
    for step in range(STEPS):
        logits = step_logits(step)
        cpu = sampler.process_logits(logits, SamplingBatch.from_requests(reqs, V))
        cuda = sampler.process_logits(logits.cuda(), SamplingBatch.from_requests(reqs, V, device="cuda"))
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-6, atol=1e-5)
        for r, t in zip(reqs, gold["tokens"][step]):
            r.append_output_token(t)


@pytest.mark.parametrize("rows", [[0, 2], [0, 1, 2]])
def test_grammar_masks_match_cpu(rows):
    matchers = [FakeMatcher(GRAMMARS[7 + i]) if i in rows else None for i in range(3)]
    logits = torch.randn(3, V)
    masked = logits.clone()
    allowed = apply_grammar_masks(masked, matchers)
    on_cuda = logits.cuda()
    allowed_cuda = apply_grammar_masks(on_cuda, matchers)
    assert torch.equal(on_cuda.cpu(), masked) and torch.equal(allowed_cuda.cpu(), allowed)


def test_grammar_masks_of_a_real_matcher(tmp_path):
    from tiny_models import build_tokenizer

    from tokenmill.sample.structured_output import StructuredOutputManager
    from tokenmill.tokenizer import load_tokenizer

    vocab = build_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    so = StructuredOutputManager(tok, vocab, frozenset({tok.convert_tokens_to_ids("<|im_end|>")}))
    matchers = [
        so.matcher_for(GuidedDecodingParams(regex="[ab]+c")),
        None,
        so.matcher_for(GuidedDecodingParams(choice=["hello", "world"])),
    ]
    logits = torch.randn(3, vocab)
    masked, on_cuda = logits.clone(), logits.cuda()
    apply_grammar_masks(masked, matchers)
    apply_grammar_masks(on_cuda, matchers)
    assert torch.equal(on_cuda.cpu(), masked)
    assert 0 < int(torch.isfinite(masked[0]).sum()) < vocab


def _syncs(fn) -> list[str]:
    """The synchronizing CUDA operations torch's sync debug mode reports while fn runs."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


def test_one_host_sync_per_step():
    """A step with every feature and logprobs waits for the GPU once: the copy of its results."""
    reqs = make_requests()
    for r in reqs[:3]:
        r.append_output_token(5)
    logits = step_logits(0).cuda()
    sampler = Sampler()
    sampler(logits, SamplingBatch.from_requests(reqs, V, device=logits.device))  # first use: generators made
    batches = []
    assert _syncs(lambda: batches.append(SamplingBatch.from_requests(reqs, V, device=logits.device))) == []
    assert len(_syncs(lambda: sampler(logits, batches[0]))) == 1
