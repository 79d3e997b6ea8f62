"""dpkern.cli.heap: the CLI's training processes ask glibc to keep freed memory (no
page faults of the per-step temporaries), unless the user chose allocator settings."""

from __future__ import annotations

import sys

import pytest

from dpkern.cli import heap


class FakeLibc:
    def __init__(self):
        self.calls = []

        def mallopt(param, value):
            self.calls.append((param, value))
            return 1

        self.mallopt = mallopt


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(sys, "platform", "linux")
    return fake


def test_applies_the_three_settings(libc):
    assert heap.keep_freed_memory(environ={"PATH": "/bin"})
    assert sorted(libc.calls) == [(-3, 32 << 20), (-2, 64 << 20), (-1, 1 << 30)]


@pytest.mark.parametrize("name", heap.TUNABLES)
def test_the_users_allocator_settings_stand(libc, name):
    assert not heap.keep_freed_memory(environ={name: "1"})
    assert libc.calls == []
    assert heap.user_settings({name: "1", "MALLOC_ARENA_MAX": "2"}) == [name]


def test_not_linux_or_no_glibc(libc, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not heap.keep_freed_memory(environ={})

    def no_libc(name):
        raise OSError("no libc.so.6")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(heap.ctypes, "CDLL", no_libc)
    assert not heap.keep_freed_memory(environ={})
    assert libc.calls == []


def test_real_mallopt_accepts_the_settings():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("no glibc")
    assert heap.keep_freed_memory(environ={})  # (this test process keeps freed memory)


@pytest.mark.usefixtures("tiny_default_model")
def test_finetune_on_cpu_applies_it(text_file, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_finetune import TINY, finetune

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    assert finetune("--data", text_file, "--steps", 1, "--out", tmp_path / "r", *TINY) == 0
    assert calls == [1]


@pytest.mark.usefixtures("tiny_default_model")
def test_finetune_says_when_the_users_settings_stand(text_file, tmp_path, monkeypatch, capsys):
    """With a MALLOC_* tunable set, glibc is left alone and the run says so in one line."""
    pytest.importorskip("transformers")
    from test_finetune import TINY, finetune

    monkeypatch.setenv("MALLOC_TOP_PAD_", "131072")
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: pytest.fail("mallopt called"))
    args = [a for a in TINY if a != "--quiet"]
    assert finetune("--data", text_file, "--steps", 1, "--out", tmp_path / "r", *args) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "MALLOC_TOP_PAD_" in ln]
    assert err == [
        "dpkern finetune: note: MALLOC_TOP_PAD_ set: glibc's heap is left as configured "
        "(dpkern would keep freed memory; see README, 'Page faults')"
    ]
