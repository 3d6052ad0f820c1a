"""The CPU kernels' ISA levels (tokenmill/kernels/isa.py, build.py): which level a CPU loads and
TOKENMILL_CPU_ISA caps it to, which units a level compiles again, and each level's module saying
which paths it runs and computing what torch computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.kernels import build, cpu_kernels, isa

pytestmark = pytest.mark.skipif(not isa.is_x86(), reason="the ISA levels are x86's")

# /proc/cpuinfo flags of CPUs users run, as far as the levels look
ZEN3 = frozenset("sse sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ICE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}

# What each level's module runs (panel_isa: bf16 linears; w8a8_isa: --quantization w8a8).
EXPECTED = {
    "generic": ("none", "scalar", False),
    "avx2": ("avx2-fma", "avx2", True),
    "avx512": ("avx2-fma", "avx2", True),
    "avx512_vnni": ("avx2-fma", "avx512-vnni", True),
    "avx512_bf16": ("avx512-bf16", "avx512-vnni", True),
    "amx": ("amx-bf16", "amx-int8", True),
}


@pytest.mark.parametrize(
    "flags, top",
    [
        (frozenset({"sse2"}), "generic"),
        (ZEN3, "avx2"),
        (SKYLAKE_SP, "avx512"),
        (ICE_LAKE, "avx512_vnni"),
        (ZEN4, "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "amx"),
        (ZEN3 - {"fma"}, "generic"),
    ],
)
def test_a_cpu_loads_its_highest_level(flags, top, monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.host_level(flags).name == top
    assert isa.selected_level(flags).name == top
    names = [lv.name for lv in isa.supported(flags)]
    assert names == isa.level_names()[: names.index(top) + 1]


def test_the_cap_selects_a_lower_level_and_refuses_a_higher_one(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert isa.selected_level(ZEN4).name == "avx2"
    monkeypatch.setenv(isa.ISA_ENV, "AMX")
    with pytest.raises(ValueError, match="this CPU runs up to avx512_bf16"):
        isa.selected_level(ZEN4)
    monkeypatch.setenv(isa.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="choose one of generic, avx2, avx512, avx512_vnni, avx512_bf16, amx"):
        isa.selected_level(ZEN4)


def test_env_for_caps_torch_too():
    assert isa.env_for("avx2") == {
        "TOKENMILL_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


def test_a_unit_is_compiled_again_only_where_a_level_changes_it():
    levels = isa.X86_LEVELS

    def eff(text: str) -> list[str]:
        return [build.effective_level(text, lv, levels).name for lv in levels]

    # no ISA macro: one object per vector width (the compiler's own vectorization changes)
    assert eff("int f() { return 1; }") == ["generic", "avx2", "avx512", "avx512", "avx512", "avx512"]
    assert eff("#if defined(__AVX512BF16__)\n#endif") == [
        "generic",
        "avx2",
        "avx512",
        "avx512",
        "avx512_bf16",
        "avx512_bf16",
    ]
    assert eff("#ifdef __AMX_TILE__\n#endif") == ["generic", "avx2", "avx512", "avx512", "avx512", "amx"]
    assert eff("__AVX512VNNI__ __AMX_INT8__") == ["generic", "avx2", "avx512", "avx512_vnni", "avx512_vnni", "amx"]


def test_the_build_plan_compiles_the_bindings_once():
    jobs, links = build.plan(isa.level_names(), build.Toolchain.find(), build.Path("/nonexistent"))
    names = [j.source.name for j in jobs]
    assert names.count(build.BINDINGS) == 1 and names.count(build.MODULE_INIT) == len(isa.level_names())
    units = build.kernel_units()
    assert len(jobs) < len(units) * len(isa.level_names())  # levels share what they do not change
    for level, objs in links.items():
        assert sorted(j.source.name for j in objs) == sorted(
            [u.name for u in units] + [build.BINDINGS, build.MODULE_INIT]
        )
        # a level links objects compiled for itself or a lower level, never a higher one
        names_ = isa.level_names()
        assert all(names_.index(j.level) <= names_.index(level) for j in objs if j.level)


@pytest.fixture(scope="module")
def level_modules():
    if not cpu_kernels.enabled():
        pytest.skip("TOKENMILL_NO_CPP_KERNELS=1")
    return {lv.name: cpu_kernels.load_level(lv.name) for lv in isa.supported()}


def test_each_level_says_what_it_runs(level_modules):
    for name, module in level_modules.items():
        panel, w8a8, fused = EXPECTED[name]
        if name == "amx" and module.panel_isa() != "amx-bf16":  # Linux may refuse the tile state
            panel, w8a8 = "avx512-bf16", "avx512-vnni"
        assert (module.isa(), module.panel_isa(), module.w8a8_isa(), hasattr(module, "FusedDecoder")) == (
            name,
            panel,
            w8a8,
            fused,
        )


def test_each_level_computes_what_torch_does(level_modules):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g)
    w = torch.rand(96, generator=g) + 0.5
    norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    gate_up = torch.randn(5, 64, generator=g)
    glu = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    weight = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    for name, module in level_modules.items():
        torch.testing.assert_close(module.rms_norm(x, w, 1e-6), norm, msg=name)
        torch.testing.assert_close(module.silu_and_mul(gate_up), glu, msg=name)
        assert torch.equal(module.argmax_rows(x), x.argmax(-1)), name
        if EXPECTED[name][0] != "none":
            y = module.panel_linear(xb, module.pack_panels(weight), 64, None)
            torch.testing.assert_close(y.float(), xb.float() @ weight.float().T, atol=0.05, rtol=0.02, msg=name)


def test_the_cap_selects_the_module_a_process_loads():
    levels = [lv.name for lv in isa.supported()]
    want = "avx2" if "avx2" in levels else "generic"
    code = (
        "from tokenmill.kernels import cpu_kernels; m = cpu_kernels.load(); print(m.isa() if m is not None else None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **isa.env_for(want)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_the_package_modules_are_skipped_when_they_no_longer_match(monkeypatch, caplog):
    """Built against another torch, or from other sources (an editable install whose csrc was edited
    since): not loaded (the fallback compiles the level instead), and the log says why."""
    level = isa.selected_level()
    if cpu_kernels._packaged(level) is None:
        pytest.skip("this installation has no prebuilt kernels for this CPU")
    monkeypatch.setattr(build, "sources_digest", lambda: "edited")
    assert cpu_kernels._packaged(level) is None
    assert "built from other sources" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_kernels._packaged(level) is None
    assert "and this is torch 0.0.0" in caplog.text
