"""Multi-LoRA kernels (csrc/lora.h): the op lora_add against a torch reference, its batch
invariance, and the fused decode step with row_slots against the op-by-op model whose adapted
linears call lora_add from forward hooks (bit-equal logits)."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import KW, _decode_steps, _fused_or_skip, _prompts, _runner

from tokenmill import LLM
from tokenmill.model.layers.bind import bind_kernels


@pytest.fixture(scope="module")
def lora_kernels(kernels):
    if not hasattr(kernels, "lora_add"):
        pytest.skip("no lora_add in the C++ kernels")
    return kernels


def _buffers(S, bounds, r_max, K, dtype, ranks, g, b_scale=1.0):
    """Random (A, Bt, ranks, slice_bounds) of one linear: S slots, slices at `bounds`."""
    ns, N = len(bounds) - 1, bounds[-1]
    A = (torch.randn(S, ns, r_max, K, generator=g) / K**0.5).to(dtype)
    Bt = (torch.randn(S, r_max, N, generator=g) * b_scale / r_max**0.5).to(dtype)
    return A, Bt, torch.tensor(ranks, dtype=torch.int32).reshape(S, ns), torch.tensor(bounds, dtype=torch.long)


def _reference(y, x, A, Bt, ranks, bounds, slots):
    """Per row: h = x @ A[s, i, :r].T in float32, y[cols] = (y.float() + h @ Bt[s, :r, cols]) rounded."""
    out = y.float().clone()
    for m, s in enumerate(slots.tolist()):
        for i in range(A.shape[1]):
            r, c0, c1 = int(ranks[s, i]), int(bounds[i]), int(bounds[i + 1])
            if s < 0 or r == 0:
                continue
            h = x[m].float() @ A[s, i, :r].float().T
            out[m, c0:c1] += h @ Bt[s, :r, c0:c1].float()
    return out.to(y.dtype)


# (K, slice bounds): 3 slices (qkv-like), 2 (gate_up-like), 1; sizes not multiples of 16 / 32.
LAYOUTS = [(77, [0, 40, 53, 66]), (64, [0, 96, 192]), (200, [0, 131]), (576, [0, 576, 768, 960]), (33, [0, 17])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,bounds", LAYOUTS)
def test_lora_add_matches_a_torch_reference(lora_kernels, dtype, K, bounds):
    """Ragged ranks per slot and slice (rank 0: untouched), -1 rows untouched, several slots mixed."""
    g = torch.Generator().manual_seed(K + len(bounds))
    S, ns, r_max = 4, len(bounds) - 1, 19
    ranks = torch.randint(1, r_max + 1, (S, ns), generator=g)
    if ns > 1:
        ranks[1, 0] = 0  # slot 1: its first slice not adapted
    ranks[3] = 0  # slot 3: empty
    ranks[2, -1] = r_max
    A, Bt, ranks, sb = _buffers(S, bounds, r_max, K, dtype, ranks.tolist(), g)
    for M in (1, 5, 23):
        x = torch.randn(M, K, generator=g).to(dtype)
        y = torch.randn(M, bounds[-1], generator=g).to(dtype)
        slots = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
        slots[0] = 1
        want = _reference(y, x, A, Bt, ranks, sb, slots)
        got = y.clone()
        lora_kernels.lora_add(got, x, A, Bt, ranks, sb, slots)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # another float32 summation order: at most one bf16 rounding step apart
            torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)
        for m, s in enumerate(slots.tolist()):  # untouched: rows without adapter, rank-0 slices
            for i in range(ns):
                if s < 0 or ranks[s, i] == 0:
                    assert torch.equal(got[m, bounds[i] : bounds[i + 1]], y[m, bounds[i] : bounds[i + 1]])
        adapted = slice(bounds[1] if ns > 1 else 0, None)  # slot 1's later slices (or its one slice)
        assert not torch.equal(got[0, adapted], y[0, adapted])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_is_batch_invariant(lora_kernels, dtype):
    """A row's bits are the same alone, in any bigger mixed batch, and with 1 or 2 threads (SmolLM2's
    gate_up shape at rank 16: big batches run on the thread pool, a lone row in the caller)."""
    g = torch.Generator().manual_seed(1)
    S, K, bounds = 5, 576, [0, 1536, 3072]
    A, Bt, ranks, sb = _buffers(S, bounds, 16, K, dtype, [16, 16, 8, 16, 16, 3, 0, 16, 12, 12], g)
    M = 37
    x = torch.randn(M, K, generator=g).to(dtype)
    y = torch.randn(M, bounds[-1], generator=g).to(dtype)
    slots = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
    whole = y.clone()
    lora_kernels.lora_add(whole, x, A, Bt, ranks, sb, slots)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            again = y.clone()
            lora_kernels.lora_add(again, x, A, Bt, ranks, sb, slots)
            assert torch.equal(again, whole)
            for m in (0, 7, 36):
                one = y[m : m + 1].clone()
                lora_kernels.lora_add(one, x[m : m + 1], A, Bt, ranks, sb, slots[m : m + 1])
                assert torch.equal(one, whole[m : m + 1])
            part = y[3:20].clone()  # other neighbours, one slot for all
            same = torch.full((17,), 2, dtype=torch.int32)
            lora_kernels.lora_add(part, x[3:20], A, Bt, ranks, sb, same)
            for m in range(3, 20):
                if slots[m] == 2:
                    assert torch.equal(part[m - 3], whole[m])
    finally:
        torch.set_num_threads(threads)


def test_lora_add_refuses_bad_inputs(lora_kernels):
    g = torch.Generator().manual_seed(2)
    A, Bt, ranks, sb = _buffers(2, [0, 8, 16], 4, 32, torch.bfloat16, [4, 4, 2, 0], g)
    x, y = torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(3, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, -1, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row_slots\\[1\\] = 2"):
        lora_kernels.lora_add(y, x, A, Bt, ranks, sb, torch.tensor([0, 2, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same dtype"):
        lora_kernels.lora_add(y.float(), x, A, Bt, ranks, sb, slots)
    with pytest.raises(RuntimeError, match="x must be"):
        lora_kernels.lora_add(y, torch.zeros(3, 31, dtype=torch.bfloat16), A, Bt, ranks, sb, slots)
    with pytest.raises(RuntimeError, match="ranks must lie"):
        lora_kernels.lora_add(y, x, A, Bt, torch.tensor([[5, 0], [0, 0]], dtype=torch.int32), sb, slots)
    with pytest.raises(RuntimeError, match="int32"):
        lora_kernels.lora_add(y, x, A, Bt, ranks, sb, slots.long())
    with pytest.raises(RuntimeError, match="slice_bounds"):
        lora_kernels.lora_add(y, x, A, Bt, ranks, torch.tensor([0, 8, 17]), slots)
    lora_kernels.lora_add(y, x, A, Bt, ranks, sb, torch.full((3,), -1, dtype=torch.int32))
    assert not y.any()


# ---- the fused decode step ---------------------------------------------------------------------

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _lora_specs(model, g):
    """Random adapters in 3 slots (slot 2 empty): layer 0's qkv (3 slices) and down, layer 1's o and
    gate_up (2 slices); ragged ranks, rank-0 slices. None elsewhere (4 entries per layer)."""
    specs = []
    for l, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden, inter = attn.qkv_proj.in_features, mlp.intermediate
        table = {  # (K, slice bounds, ranks [3 slots x slices])
            (0, "qkv_proj"): (hidden, [0, q, q + kv, q + 2 * kv], [8, 3, 0, 5, 8, 8, 0, 0, 0]),
            (0, "down_proj"): (inter, [0, hidden], [8, 2, 0]),
            (1, "o_proj"): (q, [0, hidden], [4, 8, 0]),
            (1, "gate_up_proj"): (hidden, [0, inter, 2 * inter], [0, 8, 6, 6, 0, 0]),
        }
        for name in TARGETS:
            if (l, name) in table:
                K, bounds, ranks = table[(l, name)]
                specs.append(_buffers(3, bounds, 8, K, torch.bfloat16, ranks, g, b_scale=2.0))
            else:
                specs.append(None)
    return specs


def _hooked(kernels, model, specs, row_slots):
    """Forward hooks that add each row's adapter to the outputs of the adapted linears (lora_add),
    the model bound without activations in the gate/up projections' epilogues (so that their
    forward, which the hooks watch, runs). Returns the hook handles."""
    bind_kernels(model, "cpu", next(model.parameters()).dtype, epilogues=False)
    handles = []
    for l, layer in enumerate(model.layers):
        mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for k, mod in enumerate(mods):
            spec = specs[4 * l + k]
            if spec is None:
                continue

            def hook(mod, inputs, out, spec=spec):
                x = inputs[0].reshape(-1, spec[0].shape[-1])
                kernels.lora_add(out.view(-1, spec[1].shape[-1]), x, *spec, row_slots)

            handles.append(mod.register_forward_hook(hook))
    return handles


def _fused_and_op_by_op(kernels, llm, fd, specs, ids, pos, meta, rows, kv, slots):
    runner = _runner(llm)
    handles = _hooked(kernels, runner.model, specs, slots)
    try:
        with torch.inference_mode():
            runner.kv_cache.copy_(kv)
            fused = fd(ids, pos, meta, rows, row_slots=slots)
            fused_cache = runner.kv_cache.clone()
            runner.kv_cache.copy_(kv)
            want = runner.model.compute_logits(runner.model(ids, pos, runner.attn, meta)[rows])
    finally:
        for h in handles:
            h.remove()
        bind_kernels(runner.model, "cpu", next(runner.model.parameters()).dtype)
    torch.testing.assert_close(fused_cache, runner.kv_cache, atol=0, rtol=0, equal_nan=True)
    return fused, want


def test_fused_step_with_adapters_equals_the_hooked_model(lora_kernels, tiny_llama_dir):
    """A decode batch mixing slots and -1 rows: the fused step's logits equal the op-by-op model's
    with lora_add hooks, bit for bit; without row_slots (or all -1) the step is what it was."""
    llm = LLM(tiny_llama_dir, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    ids, pos, meta, rows, kv = _decode_steps(llm, _prompts(5, llm.engine.config.model.vocab_size))[0]
    assert len(ids) == 5 and meta.all_decode
    with torch.inference_mode():
        runner.kv_cache.copy_(kv)
        base = fd(ids, pos, meta, rows)
    specs = _lora_specs(runner.model, torch.Generator().manual_seed(3))
    fd.set_lora(specs)
    try:
        slots = torch.tensor([0, -1, 1, 0, 2], dtype=torch.int32)
        fused, want = _fused_and_op_by_op(lora_kernels, llm, fd, specs, ids, pos, meta, rows, kv, slots)
        assert torch.equal(fused, want)
        assert torch.equal(fused[[1, 4]], base[[1, 4]])  # base-model row, empty slot
        assert not torch.equal(fused[0], base[0]) and not torch.equal(fused[2], base[2])
        for none in (None, torch.full((5,), -1, dtype=torch.int32)):
            with torch.inference_mode():
                runner.kv_cache.copy_(kv)
                assert torch.equal(fd(ids, pos, meta, rows, row_slots=none), base)
        with pytest.raises(RuntimeError, match="row_slots\\[2\\] = 3"):
            fd(ids, pos, meta, rows, row_slots=torch.tensor([0, -1, 3, 0, 2], dtype=torch.int32))
        with pytest.raises(RuntimeError, match="int32"):
            fd(ids, pos, meta, rows, row_slots=slots.long())
    finally:
        fd.clear_lora()
    with torch.inference_mode():
        runner.kv_cache.copy_(kv)
        assert torch.equal(fd(ids, pos, meta, rows), base)
        with pytest.raises(RuntimeError, match="set_lora was not called"):
            fd(ids, pos, meta, rows, row_slots=slots)


def test_fused_multi_row_step_with_adapters(lora_kernels, tiny_qwen2_dir):
    """Requests of several query rows (query_start_loc; qwen2: q/k/v biases, then the adapters):
    every row's logits equal the hooked op-by-op model's."""
    from tokenmill.model.layers.attention import SeqChunk

    llm = LLM(tiny_qwen2_dir, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    bs, vocab = runner.block_size, llm.engine.config.model.vocab_size
    g = torch.Generator().manual_seed(5)
    reqs = [
        (torch.randint(3, vocab, (45,), generator=g).tolist(), 40, 5, [1, 2, 3], 1),
        (torch.randint(3, vocab, (21,), generator=g).tolist(), 20, 1, [4, 5], -1),
        (torch.randint(3, vocab, (7,), generator=g).tolist(), 0, 7, [6], 0),
    ]
    with torch.inference_mode():
        for tokens, start, _, table, _ in reqs[:2]:  # their cached prefixes
            slots = [table[p // bs] * bs + p % bs for p in range(start)]
            meta = runner.attn.build_metadata([SeqChunk(0, start, 0, table)], slots, bs)
            runner.model(torch.tensor(tokens[:start]), torch.arange(start), runner.attn, meta)
    ids, pos, slots, seqs, row_slots = [], [], [], [], []
    for tokens, start, n, table, slot in reqs:
        seqs.append(SeqChunk(len(ids), n, start, table))
        ids += tokens[start : start + n]
        pos += range(start, start + n)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        row_slots += [slot] * n
    meta = runner.attn.build_metadata(seqs, slots, bs)
    ids, pos, rows = torch.tensor(ids), torch.tensor(pos), torch.arange(len(ids))
    assert not meta.all_decode and fd.accepts(meta, len(ids))
    specs = _lora_specs(runner.model, torch.Generator().manual_seed(6))
    fd.set_lora(specs)
    try:
        kv = runner.kv_cache.clone()
        fused, want = _fused_and_op_by_op(
            lora_kernels, llm, fd, specs, ids, pos, meta, rows, kv, torch.tensor(row_slots, dtype=torch.int32)
        )
    finally:
        fd.clear_lora()
    assert torch.equal(fused, want)
