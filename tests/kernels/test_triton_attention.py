"""The Triton paged-attention kernels against a plain torch reference (gather K/V through the block
table, softmax in float32). Without a GPU they run on CPU tensors in Triton's interpreter.

Whether triton interprets is fixed when its jit functions are defined, triton's own (tl.zeros,
tl.sum, ...) included, that is when triton is first imported; so TRITON_INTERPRET=1 is set here
for that import and this module's, and again while these tests run, not for the rest of the session. When something earlier in the session
imported triton without it (transformers' Llama does), the kernels cannot run in this process
(triton cannot be imported twice): the tests are skipped here and `test_in_a_fresh_process` runs
this module in a child process, failing with the child's report if any test fails there.
With a GPU the same tests run the compiled kernels."""

import os
import subprocess
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_SET_INTERPRET = DEVICE == "cpu" and "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from triton.language import zeros as _tl_zeros  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

RUNS_HERE = DEVICE == "cuda" or isinstance(_tl_zeros, InterpretedFunction)
if RUNS_HERE:
    from tokenmill.kernels import triton_attention as ta  # noqa: E402
from tokenmill.model.layers.attention import quantize_kv  # noqa: E402

if _SET_INTERPRET:  # not for what the rest of the session starts; `_interpret` sets it while these tests run
    del os.environ["TRITON_INTERPRET"]

CHILD_ENV = "TOKENMILL_TRITON_TEST_CHILD"


@pytest.fixture(autouse=True, scope="module")
def _interpret():
    """The interpreter also reads the variable while kernels run."""
    if _SET_INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _SET_INTERPRET:
        del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _runs_here(request):
    if not RUNS_HERE and request.node.name != "test_in_a_fresh_process":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process: test_in_a_fresh_process runs this")


@pytest.mark.timeout(300)
def test_in_a_fresh_process():
    if RUNS_HERE:
        pytest.skip("the kernels run in this process")
    assert not os.environ.get(CHILD_ENV), "triton was imported before this module even in a fresh process"
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]


BS = 16  # block size


class PagedCache:
    """A paged K/V cache whose blocks are handed out in shuffled order; every slot no request
    owns (the null block 0 included) holds NaN (NaN scales for int8), so a kernel that reads
    one, or lets one into a sum, fails the comparison. `quant`: an int8 / float8 e4m3 cache, or None."""

    def __init__(self, num_blocks: int, hkv: int, d: int, dtype: torch.dtype, quant: torch.dtype | None, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.hkv, self.d, self.dtype, self.quant = hkv, d, dtype, quant
        n = num_blocks * BS
        if quant is not None:
            self.k = torch.zeros(n, hkv, d, dtype=quant)
            self.v = torch.zeros(n, hkv, d, dtype=quant)
            self.k_scale = torch.full((n, hkv), float("nan"))
            self.v_scale = torch.full((n, hkv), float("nan"))
        else:
            self.k = torch.full((n, hkv, d), float("nan"), dtype=dtype)
            self.v = torch.full((n, hkv, d), float("nan"), dtype=dtype)
            self.k_scale = self.v_scale = None
        self.free = (torch.randperm(num_blocks - 1, generator=self.g) + 1).tolist()  # never the null block

    def add(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A request of `length` tokens: its block table and its K/V [length, Hkv, D] as stored (dequantized, float32)."""
        blocks = torch.tensor([self.free.pop() for _ in range(-(-length // BS))], dtype=torch.int64)
        pos = torch.arange(length)
        slots = blocks[pos // BS] * BS + pos % BS
        k = torch.randn(length, self.hkv, self.d, generator=self.g)
        v = torch.randn(length, self.hkv, self.d, generator=self.g)
        if self.quant is not None:
            for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                xq, xs = quantize_kv(x, self.quant)
                cache.view(torch.uint8)[slots], scales[slots] = xq.view(torch.uint8), xs
            k = self.k[slots].float() * self.k_scale[slots].unsqueeze(-1)
            v = self.v[slots].float() * self.v_scale[slots].unsqueeze(-1)
        else:
            self.k[slots], self.v[slots] = k.to(self.dtype), v.to(self.dtype)
            k, v = self.k[slots].float(), self.v[slots].float()
        return blocks, k, v

    def args(self) -> tuple:
        dev = [t.to(DEVICE) if t is not None else None for t in (self.k, self.v, self.k_scale, self.v_scale)]
        return dev[0], dev[1], dev[2], dev[3]


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [n, H, D] at positions context_len.., k/v [L, Hkv, D] float32 -> [n, H, D] float32, causal
    (window > 0: each query sees its last `window` keys; softcap > 0: scores soft-capped)."""
    n, H, _ = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril_(diagonal=context_len)
    if window:
        mask &= ~torch.ones(n, k.shape[0], dtype=torch.bool).tril_(diagonal=context_len - window)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def block_table_rows(tables: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(tables), width, dtype=torch.int64)  # padding -> the null block
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def run_decode(lens, heads, kv_heads, d, dtype, quant, num_splits, width=None, seed=0):
    cache = PagedCache(64, kv_heads, d, dtype, quant, seed)
    reqs = [cache.add(n) for n in lens]
    q = torch.randn(len(lens), heads, d, generator=cache.g).to(dtype)
    tables = block_table_rows([r[0] for r in reqs], width or max(len(r[0]) for r in reqs))
    scale = d**-0.5
    out = ta.paged_decode(
        q.to(DEVICE),
        *cache.args()[:2],
        tables.to(DEVICE),
        torch.tensor(lens).to(DEVICE),
        BS,
        scale,
        *cache.args()[2:],
        num_splits=num_splits,
    ).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    for i, (_, k, v) in enumerate(reqs):
        torch.testing.assert_close(
            out[i].float(), reference(q[i : i + 1], k, v, lens[i] - 1, scale)[0], **tolerance(dtype)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["nosplit", "split4"])
def test_decode(dtype, heads, kv_heads, d, num_splits):
    # Lengths off the block size, a single token, and a request that leaves some of its 4 splits empty.
    run_decode([37, 1, 16, 70], heads, kv_heads, d, dtype, None, num_splits)


QUANT = [torch.int8, torch.float8_e4m3fn]
QUANT_IDS = ["int8", "fp8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["nosplit", "split4"])
@pytest.mark.parametrize("quant", QUANT, ids=QUANT_IDS)
def test_decode_quantized_cache(dtype, num_splits, quant):
    run_decode([37, 5, 50], 8, 2, 64, dtype, quant, num_splits)


def test_decode_odd_group_and_head_dim():
    # SmolLM2's 3 query heads per kv head, and a head dim that is not a power of two (padded in the kernel).
    run_decode([21, 40], 6, 2, 80, torch.float32, None, 2)


def test_decode_default_splits_from_table_width():
    # A table 40 blocks wide (640 keys) gets 2 splits by default; the requests are shorter than that.
    assert min(ta.MAX_SPLITS, -(-40 * BS // ta.DEFAULT_PARTITION)) == 2
    run_decode([100, 9], 4, 2, 64, torch.float32, None, None, width=40)


def test_decode_padded_row_is_zero():
    # A batch padded with a seq_len 0 row (as a CUDA graph's fixed batch is) gives zeros there, not NaN.
    cache = PagedCache(8, 2, 64, torch.float32, None, 1)
    blocks, k, v = cache.add(20)
    q = torch.randn(2, 4, 64, generator=cache.g)
    tables = block_table_rows([blocks, torch.zeros(0, dtype=torch.int64)], 2)
    for splits in (1, 2):
        out = ta.paged_decode(
            q.to(DEVICE),
            *cache.args()[:2],
            tables.to(DEVICE),
            torch.tensor([20, 0]).to(DEVICE),
            BS,
            0.125,
            num_splits=splits,
        ).cpu()
        torch.testing.assert_close(out[0], reference(q[:1], k, v, 19, 0.125)[0], **tolerance(torch.float32))
        assert torch.equal(out[1], torch.zeros(4, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 128)], ids=["gqa-d64", "mha-d128"])
@pytest.mark.parametrize("context_len", [0, 21], ids=["fresh", "prefix"])
@pytest.mark.parametrize("quant", [None, torch.int8], ids=["kv", "kv-int8"])
def test_prefill(dtype, heads, kv_heads, d, context_len, quant):
    q_len = 19  # not a multiple of the query tile: the last tile is ragged
    cache = PagedCache(16, kv_heads, d, dtype, quant, 2)
    blocks, k, v = cache.add(context_len + q_len)
    q = torch.randn(q_len, heads, d, generator=cache.g).to(dtype)
    scale = d**-0.5
    kc, vc, ks, vs = cache.args()
    # Query tiles of 16 rows: 4 tokens x 4 heads (GQA) or 16 tokens (MHA), so several tiles per chunk.
    out = ta.paged_prefill(q.to(DEVICE), kc, vc, blocks.to(DEVICE), context_len, BS, scale, ks, vs, block_m=16).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(q, k, v, context_len, scale), **tolerance(dtype))


def _free_before(blocks: torch.Tensor, first_pos: int, window: int) -> torch.Tensor:
    """The table with the blocks wholly before first_pos's window pointing at the (NaN) null block,
    as the KV manager leaves a request's freed blocks."""
    blocks = blocks.clone()
    blocks[: max(0, first_pos + 1 - window) // BS] = 0
    return blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["nosplit", "split4"])
def test_decode_window_and_softcap(dtype, num_splits):
    lens, window, cap, scale = [37, 1, 16, 70, 90], 13, 5.0, 0.3
    cache = PagedCache(64, 2, 64, dtype, None, 4)
    reqs = [cache.add(n) for n in lens]
    q = torch.randn(len(lens), 8, 64, generator=cache.g).to(dtype)
    tables = block_table_rows([_free_before(r[0], n - 1, window) for r, n in zip(reqs, lens)], 6)
    out = ta.paged_decode(
        q.to(DEVICE),
        *cache.args()[:2],
        tables.to(DEVICE),
        torch.tensor(lens).to(DEVICE),
        BS,
        scale,
        num_splits=num_splits,
        window=window,
        softcap=cap,
    ).cpu()
    for i, (_, k, v) in enumerate(reqs):
        torch.testing.assert_close(
            out[i].float(), reference(q[i : i + 1], k, v, lens[i] - 1, scale, window, cap)[0], **tolerance(dtype)
        )


@pytest.mark.parametrize("quant", [None, torch.int8], ids=["kv", "kv-int8"])
def test_prefill_window_and_softcap(quant):
    # A fresh prompt longer than the window, chunks after cached prefixes, a single token; query
    # tiles of 16 rows (8 tokens x 2 heads), so later tiles start past the first one's window.
    chunks, window, cap, scale = [(0, 30), (30, 9), (44, 1), (5, 40)], 11, 3.0, 0.25
    heads, kv_heads, d, dtype = 4, 2, 64, torch.float32
    cache = PagedCache(32, kv_heads, d, dtype, quant, 5)
    reqs = [cache.add(c + n) for c, n in chunks]
    q = torch.randn(sum(n for _, n in chunks), heads, d, generator=cache.g).to(dtype)
    loc = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    tables = block_table_rows([_free_before(r[0], c, window) for r, (c, _) in zip(reqs, chunks)], 4)
    kc, vc, ks, vs = cache.args()
    out = ta.paged_prefill_varlen(
        q.to(DEVICE),
        kc,
        vc,
        loc.to(DEVICE),
        seq_lens.to(DEVICE),
        tables.to(DEVICE),
        40,
        BS,
        scale,
        ks,
        vs,
        block_m=16,
        window=window,
        softcap=cap,
    ).cpu()
    for i, ((c, _n), (_, k, v)) in enumerate(zip(chunks, reqs)):
        rows = slice(loc[i], loc[i + 1])
        torch.testing.assert_close(
            out[rows].float(), reference(q[rows], k, v, c, scale, window, cap), **tolerance(dtype)
        )


@pytest.mark.parametrize("quant", [None, *QUANT], ids=["kv", *QUANT_IDS])
def test_prefill_varlen(quant):
    # Three requests in one launch: a fresh prompt, a chunk over a cached prefix, a single-token chunk;
    # the default 64-row query tiles hold 21 tokens x 3 heads and one padding row.
    chunks = [(0, 13), (30, 9), (44, 1)]  # (context_len, q_len)
    heads, kv_heads, d, dtype = 6, 2, 64, torch.bfloat16
    cache = PagedCache(24, kv_heads, d, dtype, quant, 3)
    reqs = [cache.add(c + n) for c, n in chunks]
    q = torch.randn(sum(n for _, n in chunks), heads, d, generator=cache.g).to(dtype)
    loc = torch.tensor([0, 13, 22, 23], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    tables = block_table_rows([r[0] for r in reqs], 4)
    kc, vc, ks, vs = cache.args()
    out = ta.paged_prefill_varlen(
        q.to(DEVICE), kc, vc, loc.to(DEVICE), seq_lens.to(DEVICE), tables.to(DEVICE), 13, BS, d**-0.5, ks, vs
    ).cpu()
    for i, ((c, _n), (_, k, v)) in enumerate(zip(chunks, reqs)):
        rows = slice(loc[i], loc[i + 1])
        torch.testing.assert_close(out[rows].float(), reference(q[rows], k, v, c, d**-0.5), **tolerance(dtype))


COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from tokenmill.kernels import triton_attention as ta

PTRS = {"bt_ptr": "*i64", "q_start_ptr": "*i32", "seq_lens_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
        "part_ptr": "*fp32", "stats_ptr": "*fp32"}

def compile_(fn, dtype, kv_dtype, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = PTRS.get(name, "*" + (kv_dtype if name in ("k_ptr", "v_ptr") else dtype))
        else:
            sig[name] = "fp32" if name in ("qk_scale", "softcap") else "i32"
    triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

for dtype, kv_dtype, prec in (("bf16", "bf16", "tf32"), ("fp32", "i8", "ieee"), ("bf16", "fp8e4nv", "tf32")):
    int8 = kv_dtype != dtype
    for splits in (1, 4):
        compile_(ta._decode_kernel, dtype, kv_dtype, dict(GROUP=3, BLOCK_H=16, BLOCK_N=32, HEAD_DIM=128,
                 NUM_SPLITS=splits, INT8=int8, PRECISION=prec, DOT_F32=False, SOFTCAP=splits == 4))
    for softcap in (False, True):
        compile_(ta._prefill_kernel, dtype, kv_dtype, dict(GROUP=3, BLOCK_Q=21, BLOCK_M=64, BLOCK_N=32, HEAD_DIM=64,
                 INT8=int8, PRECISION=prec, DOT_F32=False, SOFTCAP=softcap))
compile_(ta._merge_kernel, "bf16", "bf16", dict(NUM_SPLITS=4, HEAD_DIM=128))
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kernels_compile_for_a_gpu(tmp_path):
    # The interpreter accepts what a GPU compile refuses (a loop-carried value changing type, dots
    # under 16 x 16): compile the kernels for sm_90 (H100) down to a cubin with the wheel's ptxas, no
    # GPU needed. In a child process: the kernels there are compiled ones, not the interpreter's.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0 and r.stdout.strip().endswith("compiled"), r.stdout[-3000:] + r.stderr[-3000:]
