"""DeepSpeed's C++ ops: a first build announces itself and shows progress, a cached op
is loaded silently, and the cache is novarl's folder. Nothing is compiled: the cache
folder is made by hand."""

import os
import time

import pytest
import torch

from novarl.backends.training import ops

WHAT = "DeepSpeed's cpu_adam op"


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_first_build_announces_the_build_when_the_op_is_not_cached(extensions_dir, capsys):
    (extensions_dir / "cpu_adam").mkdir()  # an interrupted build leaves the folder without its .so
    (extensions_dir / "fused_adam").mkdir()
    (extensions_dir / "fused_adam" / "fused_adam.so").write_bytes(b"")  # another op's .so does not count
    ran = []
    with ops.first_build("cpu_adam", WHAT):
        ran.append(True)
    lines = capsys.readouterr().err.splitlines()
    assert ran == [True]
    assert lines[0] == (f"[novarl] building {WHAT} with the C++ compiler (first use only, about 30-45 s on 2 cores; "
                        f"cached in {extensions_dir})")
    assert lines[-1] == "[novarl] done in 0 s"


def test_first_build_is_silent_when_the_op_is_cached(extensions_dir, capsys):
    (extensions_dir / "cpu_adam").mkdir()
    (extensions_dir / "cpu_adam" / "x.so").write_bytes(b"")
    ran = []
    with ops.first_build("cpu_adam", WHAT):
        ran.append(True)
    captured = capsys.readouterr()
    assert ran == [True]
    assert (captured.out, captured.err) == ("", "")


def test_progress_says_it_is_still_working_then_done(monkeypatch, capsys):
    monkeypatch.setattr(ops, "PROGRESS_EVERY_S", 0.05)
    with ops.progress("building a test op"):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[novarl] building a test op"
    assert lines[1:-1] and set(lines[1:-1]) == {"[novarl] ... still working (0 s)"}
    assert lines[-1] == "[novarl] done in 0 s"


def test_op_cache_defaults_to_novarls_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("NOVARL_CACHE_DIR", str(tmp_path))
    ops.deepspeed_environment()
    folder = os.environ["TORCH_EXTENSIONS_DIR"]  # this torch's version and installation
    assert folder == str(ops.extensions_dir(torch.__version__, torch.__file__))
    assert folder.startswith(str(tmp_path / "torch_extensions" / f"{torch.__version__}-"))
    assert ops.extensions_dir(torch.__version__, "/another/venv/torch/__init__.py") != ops.extensions_dir(
        torch.__version__, torch.__file__)  # another environment's torch builds its own
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")  # the user's setting wins
    ops.deepspeed_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"
