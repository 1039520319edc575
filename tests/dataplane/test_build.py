"""The compiled module: importable without torch or a GPU, linked against neither libcuda nor libtorch."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from elastic_kv import _vmm


def _run(tool: str, *args: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} (binutils) is needed to inspect the extension")
    return subprocess.run([path, *args], check=True, capture_output=True, text=True).stdout


def test_module_needs_no_cuda_or_torch_library() -> None:
    dynamic = _run("readelf", "-d", _vmm.__file__)
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed, "readelf found no NEEDED entries at all: the check itself is broken"
    for lib in needed:
        assert not lib.startswith(("libcuda", "libcudart", "libamdhip", "libtorch", "libc10")), needed


def test_module_leaves_no_driver_or_torch_symbol_undefined() -> None:
    undefined = _run("nm", "-D", "--undefined-only", _vmm.__file__).split()
    assert any(sym.startswith("dlopen") for sym in undefined), "the driver must be reached through dlopen"
    offenders = [s for s in undefined if s.startswith(("cu", "hip", "_ZN2at", "_ZN3c10", "_ZN5torch"))]
    assert offenders == []


def test_import_does_not_import_torch() -> None:
    code = "import sys; from elastic_kv import _vmm; _vmm.HostBackend(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_missing_driver_library_is_a_config_error() -> None:
    from elastic_kv.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot load"):
        _vmm.CudaBackend(0, library="libcuda-does-not-exist.so.1")
    with pytest.raises(ConfigError, match="cannot load"):
        _vmm.HipBackend(0, library="libamdhip64-does-not-exist.so")
