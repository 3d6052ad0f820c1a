"""What a first run shows: `--version`, the fallback C++ kernel build of an installation without
prebuilt kernels (keyed by environment, logged before and after, visible when waiting on another
process's build, `build-kernels`, never counted as weight loading), progress bars on a terminal
only, and progress lines in the log without one (weight loading, GGUF conversion). The prebuilt
kernels and their ISA levels: test_kernel_isa.py."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import sys
import threading
import types

import pytest

from tokenmill import progress
from tokenmill.cli import main
from tokenmill.kernels import cpu_kernels
from tokenmill.model import loader


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Events(logging.Handler):
    """Sets an event when a tokenmill log message contains the awaited text."""

    def __init__(self, text: str):
        super().__init__(logging.DEBUG)
        self.text, self.seen, self.messages = text, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.text in self.messages[-1]:
            self.seen.set()


@pytest.fixture
def events():
    log = logging.getLogger("tokenmill")
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the loggers' isEnabledFor cache
    handlers = []

    def watch(text: str) -> _Events:
        h = _Events(text)
        log.addHandler(h)
        handlers.append(h)
        return h

    yield watch
    for h in handlers:
        log.removeHandler(h)
    log.setLevel(level)


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """cpu_kernels as in a new process of an installation without prebuilt kernels, building into
    tmp_path; the compile itself is replaced by a stand-in (set `.fail` to make it raise) so no
    test waits for a compiler."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setattr(cpu_kernels, "_origin", None)
    monkeypatch.setattr(cpu_kernels, "_packaged", lambda level: None)
    fake = types.SimpleNamespace(module=types.SimpleNamespace(isa=lambda: "fake"), fail=None, built_in=[])

    def load_ext(folder, level):
        fake.built_in.append(folder)
        if fake.fail:
            raise RuntimeError(fake.fail)

    monkeypatch.setattr(cpu_kernels, "_load_ext", load_ext)
    monkeypatch.setattr(cpu_kernels, "_import_file", lambda path, level: fake.module)
    return fake


def test_version(capsys):
    from tokenmill import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tokenmill {__version__}"


def test_cache_directory_keyed_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    here = cpu_kernels.cache_directory("avx2")
    assert here.parent == tmp_path / "kernels" and here.name.startswith("avx2-")
    assert cpu_kernels.cache_directory("avx2") == here  # stable
    assert cpu_kernels.cache_directory("generic") != here  # each level apart
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert cpu_kernels.cache_directory("avx2") != here  # a second venv builds apart


def test_build_is_logged_and_waits_visibly_on_another_builder(fresh_kernels, events):
    build_dir = cpu_kernels.cache_directory()
    build_dir.mkdir(parents=True)
    waiting = events("waiting for another process (pid 4242) building the CPU kernels in " + str(build_dir))
    got = []
    with open(build_dir / "tokenmill.flock", "w") as held:  # another process's build, as it would hold it
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        t = threading.Thread(target=lambda: got.append(cpu_kernels.load()))
        t.start()
        assert waiting.seen.wait(60), waiting.messages
        assert not fresh_kernels.built_in  # blocked on the lock, not building alongside
        fcntl.flock(held, fcntl.LOCK_UN)
    t.join(60)
    assert got == [fresh_kernels.module] and fresh_kernels.built_in == [build_dir]
    level = cpu_kernels._kernels()[1].selected_level().name
    compiling = [m for m in waiting.messages if m.startswith(f"compiling the CPU kernels for {level} into {build_dir}")]
    assert compiling and "tokenmill build-kernels" in compiling[0]
    assert any(m.startswith("compiled the CPU kernels in ") for m in waiting.messages)
    assert (build_dir / "tokenmill.flock").read_text() == str(os.getpid())  # for the next waiter


def test_build_kernels_command(fresh_kernels, capsys):
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels ready: fake in " in out and str(cpu_kernels.cache_directory()) in out


def test_build_kernels_command_says_why_it_failed(fresh_kernels, capsys):
    fresh_kernels.fail = "no C++ compiler found"
    assert main(["build-kernels"]) == 1
    assert "no C++ compiler found" in capsys.readouterr().err


def test_weight_load_time_excludes_kernel_build(tiny_llama_dir, monkeypatch, events):
    """A first run's compile happens before the weights' clock starts: on a fake clock that only
    moves while the kernels 'build', loading takes no time at all."""
    clock = [0.0]
    real_load = cpu_kernels.load

    def slow_first_load():
        if clock[0] == 0.0:
            clock[0] = 1000.0
        return real_load()

    monkeypatch.setattr(cpu_kernels, "load", slow_first_load)
    monkeypatch.setattr(loader, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    loaded = events("loaded weights from")
    import torch

    loader.load_model(tiny_llama_dir, loader.load_hf_config(tiny_llama_dir), torch.float32, 64)
    assert clock[0] == 1000.0
    line = next(m for m in loaded.messages if "loaded weights from" in m)
    assert line.rsplit(" in ", 1)[1].startswith("0.00s"), line


def test_progress_bars_on_a_terminal_only(tiny_llama_dir, monkeypatch):
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.offline import measure_latency

    for stream, shown in ((io.StringIO(), False), (_Tty(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)
        llm.generate(["Hello", "world"], SamplingParams(max_tokens=2))
        measure_latency(llm, input_len=4, output_len=2, iters=2)
        out = stream.getvalue()
        for bar in ("Loading weights", "Generating", "Latency runs"):
            assert (bar in out) == shown, (bar, out)


def test_progress_lines_in_the_log_without_a_terminal(tiny_llama_dir, monkeypatch, events):
    """Without a terminal (a log file, `kubectl logs`) a load logs where it is every LOG_INTERVAL_S
    (0 here: after every tensor but the last); on a terminal the bar says it instead."""
    import torch

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    for stream, logged in ((io.StringIO(), True), (_Tty(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        lines = events("Loading weights: ")
        loader.load_model(tiny_llama_dir, loader.load_hf_config(tiny_llama_dir), torch.float32, 64)
        got = [m for m in lines.messages if m.startswith("Loading weights: ")]
        assert bool(got) == logged, (stream, got)
        if logged:
            assert got[0].startswith("Loading weights: 1/") and " tensors (" in got[0], got


def test_gguf_conversion_logs_progress_without_a_terminal(tiny_llama_dir, tmp_path, monkeypatch, events):
    from gguf_writer import write_gguf_from_hf

    from tokenmill.model.gguf_loader import gguf_to_hf_folder

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    path = write_gguf_from_hf(tiny_llama_dir, tmp_path / "tiny.gguf")
    lines = events("Converting tiny.gguf: 1/")
    gguf_to_hf_folder(str(path), cache_dir=str(tmp_path / "cache"))
    assert lines.seen.is_set(), lines.messages
