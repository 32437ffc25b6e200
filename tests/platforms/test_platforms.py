"""Device platforms: detection with the device packages absent, the missing-package errors,
the support matrix, runner refusal, memory sizing and device indices, and ``check-device``."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from pyxllm import kernels, platforms
from pyxllm.cli.main import main
from pyxllm.config import GRAPH_BACKENDS, PLATFORMS, EngineConfig
from pyxllm.distributed.parallel_state import destroy_distributed, init_distributed, tp_state
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.executor.model_executor import resolve_dtype
from pyxllm.executor.multiproc import free_local_port
from pyxllm.executor.runners import DeviceGraphCapture, TraceCapture, graph_capture_for
from pyxllm.models import registry
from pyxllm.platforms import PlatformUnavailableError, cpu, interface, resolve_platform
from pyxllm.platforms.cuda import CUDA_PLATFORM
from pyxllm.platforms.interface import GIB, Platform
from pyxllm.platforms.mlu import MLU_PLATFORM
from pyxllm.platforms.npu import NPU_PLATFORM
from tests.model_fixtures import build_checkpoint

CPU_PLATFORM = cpu.load()
ALL = {"cpu": CPU_PLATFORM, "cuda": CUDA_PLATFORM, "npu": NPU_PLATFORM, "mlu": MLU_PLATFORM}


@pytest.fixture
def no_device_packages(monkeypatch):
    """As on a machine without torch_npu, torch_mlu, flash-attn, and a torch without CUDA."""
    real = interface.package_installed
    absent = {"torch_npu", "torch_mlu", "flash_attn"}
    monkeypatch.setattr(
        interface, "package_installed", lambda name: name not in absent and real(name)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


@pytest.fixture(autouse=True)
def keep_cpu_bound():
    yield
    platforms.set_current_platform(CPU_PLATFORM)


# --- detection and missing packages --------------------------------------------------------


def test_auto_is_cpu_without_device_packages(no_device_packages):
    assert platforms.detect_device() == "cpu"
    assert resolve_platform("auto") is CPU_PLATFORM
    assert EngineConfig().device == "auto"


def test_auto_prefers_cuda_then_npu_then_mlu(monkeypatch):
    seen = []

    def fake(name, available):
        def is_available():
            seen.append(name)
            return available

        return SimpleNamespace(is_available=is_available)

    modules = {"cuda": fake("cuda", False), "npu": fake("npu", True), "mlu": fake("mlu", True)}
    monkeypatch.setattr(platforms, "platform_module", modules.__getitem__)
    assert platforms.detect_device() == "npu"
    assert seen == ["cuda", "npu"]


@pytest.mark.parametrize(
    "device, package, command",
    [
        ("npu", "torch_npu", "pip install torch-npu=="),
        ("mlu", "torch_mlu", "pip install"),
        ("cuda", "CUDA build of torch", "pip install --force-reinstall torch=="),
    ],
)
def test_a_missing_device_package_names_it_and_the_install_command(
    no_device_packages, device, package, command
):
    with pytest.raises(PlatformUnavailableError) as exc:
        resolve_platform(device)
    message = str(exc.value)
    assert package in message and command in message and f"device {device}" in message
    assert interface.torch_release() in message


def test_cuda_built_but_no_gpu(no_device_packages, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(PlatformUnavailableError, match="sees no GPU.*CUDA_VISIBLE_DEVICES"):
        resolve_platform("cuda")


@pytest.mark.parametrize(
    "device, checks",
    [
        ("npu", "check ASCEND_RT_VISIBLE_DEVICES, the driver (npu-smi info) and that the CANN"),
        ("mlu", "check MLU_VISIBLE_DEVICES and the driver (cnmon)"),
    ],
)
def test_an_adapter_that_sees_no_card_names_what_to_check(monkeypatch, device, checks):
    package = f"torch_{device}"
    monkeypatch.setattr(interface, "package_installed", lambda name: name == package)
    monkeypatch.setitem(sys.modules, package, SimpleNamespace())
    monkeypatch.setattr(Platform, "device_module", lambda self: SimpleNamespace(is_available=bool))
    assert not platforms.platform_module(device).is_available()
    with pytest.raises(PlatformUnavailableError) as exc:
        resolve_platform(device)
    assert str(exc.value).startswith(f"device {device}: {package} sees no {device.upper()}; ")
    assert checks in str(exc.value)


def test_the_engine_fails_at_start_up_before_loading_anything(no_device_packages, monkeypatch):
    loaded = []
    monkeypatch.setattr("pyxllm.engine.frontend.resolve_model_source", lambda *a: loaded.append(a))
    with pytest.raises(PlatformUnavailableError, match="torch_npu"):
        LLMEngine(EngineConfig(device="npu"))
    assert loaded == []


def test_the_cli_prints_one_error_line(no_device_packages, capsys):
    assert main(["generate", "hi", "--device", "npu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: device npu needs torch_npu") and "pip install torch-npu" in err
    assert len(err.splitlines()) == 1


def test_an_unknown_device_names_the_flag(capsys):
    with pytest.raises(ValueError, match="--device"):
        EngineConfig(device="tpu")
    with pytest.raises(SystemExit):
        main(["serve", "--device", "tpu"])
    assert "--device" in capsys.readouterr().err


def test_device_kernel_packages_import_only_with_their_library(no_device_packages):
    with pytest.raises(ImportError, match="torch_npu"):
        kernels.bind(NPU_PLATFORM.kernels_module)
    for platform in (CPU_PLATFORM, CUDA_PLATFORM, MLU_PLATFORM):  # pure-PyTorch underneath
        ops = kernels.bind(platform.kernels_module)
        assert set(ops.__all__) == set(importlib.import_module("pyxllm.kernels.native").__all__)


def test_a_platforms_own_kernels_replace_the_native_ones():
    from pyxllm.kernels import native
    from pyxllm.kernels.cpu import fused, quantized
    from pyxllm.kernels.cuda import paged_cache

    cpu_ops = kernels.bind(CPU_PLATFORM.kernels_module)
    assert cpu_ops.int8_linear is quantized.int8_linear  # ATen's CPU kernel
    # int4: the fused W4A8 kernel with its own packing, else ATen's kernel and packing
    int4 = fused if fused.load() is not None else quantized
    for name in ("int4_linear", "pack_int4_weight"):
        assert getattr(cpu_ops, name) is getattr(int4, name), name
    cuda_ops = kernels.bind(CUDA_PLATFORM.kernels_module)
    assert cuda_ops.reshape_and_cache is paged_cache.reshape_and_cache  # capturable
    assert kernels.bind(MLU_PLATFORM.kernels_module).reshape_and_cache is native.reshape_and_cache


# --- what each platform does ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, accepted",
    [
        ("cpu", {"eager", "compile", "graph"}),
        ("cuda", {"eager", "compile", "graph"}),
        ("npu", {"eager", "graph"}),
        ("mlu", {"eager"}),
    ],
)
def test_each_platform_runs_its_runners_and_refuses_the_others(name, accepted):
    platform = ALL[name]
    for kind in GRAPH_BACKENDS:
        if kind in accepted:
            platform.check_runner(kind)
        else:
            with pytest.raises(ValueError, match=f"{kind} is not supported on device {name}"):
                platform.check_runner(kind)


def test_the_graph_runner_gets_the_platforms_capture(monkeypatch):
    assert isinstance(graph_capture_for(CPU_PLATFORM), TraceCapture)
    with tp_state(0, 2), pytest.raises(ValueError, match="cannot record collectives"):
        graph_capture_for(CPU_PLATFORM)  # a TorchScript trace cannot; a device graph can
    for platform, graph_class in ((CUDA_PLATFORM, "CUDAGraph"), (NPU_PLATFORM, "NPUGraph")):
        module = SimpleNamespace(graph_pool_handle=lambda: "pool", **{graph_class: type})
        monkeypatch.setattr(Platform, "device_module", lambda self, module=module: module)
        with tp_state(0, 2):
            capture = graph_capture_for(platform)
        assert isinstance(capture, DeviceGraphCapture)
        assert capture.device_module is module and capture.pool == "pool"
    with pytest.raises(ValueError, match="graph runner needs a graph_capture"):
        dataclasses.replace(MLU_PLATFORM, runners=("eager", "graph"))


@pytest.mark.parametrize(
    "name, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl"), ("mlu", "cncl")]
)
def test_init_distributed_joins_with_the_platforms_backend(monkeypatch, name, backend):
    joined = []
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend, store, rank, world_size: joined.append((backend, rank, world_size)),
    )
    monkeypatch.setattr(Platform, "device_index", lambda self, local_rank: local_rank)
    monkeypatch.setattr(Platform, "device", lambda self, index=0: torch.device("cpu"))
    try:
        init_distributed(ALL[name], 0, 1, f"127.0.0.1:{free_local_port()}", 5.0)
    finally:
        destroy_distributed()
    assert joined == [(backend, 0, 1)]


def test_the_cpu_splits_its_cores_between_ranks_an_accelerator_does_not(monkeypatch, fake_card):
    monkeypatch.setattr(interface, "usable_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert [CPU_PLATFORM.threads_per_rank(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # e.g. OMP_NUM_THREADS=3
    assert CPU_PLATFORM.threads_per_rank(2) == 3
    assert fake_card.threads_per_rank(4) == 3


@pytest.mark.parametrize("name", PLATFORMS)
def test_every_device_resolves_to_its_platform_or_names_what_is_missing(no_device_packages, name):
    if name == "cpu":
        assert resolve_platform(name).name == name
        return
    with pytest.raises(PlatformUnavailableError, match=f"^device {name}"):
        resolve_platform(name)


def test_support_matrix_is_data_and_checked(monkeypatch):
    for arch, entry in registry.MODEL_REGISTRY.items():
        for name in PLATFORMS:  # every platform runs every architecture today
            assert (
                registry.resolve_model_class(SimpleNamespace(architectures=[arch]), name).__name__
                == entry.class_name
            )
    config = SimpleNamespace(architectures=["LlamaForCausalLM"])
    monkeypatch.setitem(
        registry.MODEL_REGISTRY,
        "LlamaForCausalLM",
        registry.RegisteredModel("pyxllm.models.does_not_exist", "X", frozenset({"cuda"})),
    )
    with pytest.raises(ValueError, match="not supported on device cpu; it runs on cuda"):
        registry.resolve_model_class(config, "cpu")  # refused before the module is imported


@pytest.mark.parametrize(
    "platform, kind",
    [(NPU_PLATFORM, "compile"), (MLU_PLATFORM, "graph"), (MLU_PLATFORM, "compile")],
)
def test_a_runner_the_platform_lacks_is_refused_by_name(platform, kind):
    with pytest.raises(ValueError) as exc:
        platform.check_runner(kind)
    assert f"--graph-backend {kind} is not supported on device {platform.name}" in str(exc.value)
    assert ", ".join(platform.runners) in str(exc.value)


def test_float16_checkpoints_per_platform():
    fp16 = SimpleNamespace(dtype="float16")
    assert resolve_dtype("auto", CPU_PLATFORM, fp16) == torch.bfloat16
    assert resolve_dtype("auto", CUDA_PLATFORM, fp16) == torch.float16
    assert resolve_dtype("auto", CPU_PLATFORM, SimpleNamespace()) == torch.float32
    assert resolve_dtype("auto", CUDA_PLATFORM, SimpleNamespace()) == torch.bfloat16
    # an explicit float16 too becomes bfloat16 on the CPU (with a warning), as in vLLM: the fused
    # CPU kernels take float32 and bfloat16; an accelerator keeps it
    assert resolve_dtype("float16", CPU_PLATFORM, fp16) == torch.bfloat16
    assert resolve_dtype("float16", CUDA_PLATFORM, fp16) == torch.float16


def test_attention_backend_choice(monkeypatch):
    torch_paged = "pyxllm.attention.torch_paged:TorchPagedAttentionBackend"
    monkeypatch.setattr(interface, "package_installed", lambda name: False)
    assert CUDA_PLATFORM.select_attention_backend(256) == torch_paged
    monkeypatch.setattr(interface, "package_installed", lambda name: name == "flash_attn")
    assert CUDA_PLATFORM.select_attention_backend(16) == torch_paged  # flash-attn: 256-token pages
    assert (
        CUDA_PLATFORM.select_attention_backend(256)
        == "pyxllm.attention.flash_attn:FlashAttnBackend"
    )
    assert CPU_PLATFORM.select_attention_backend(256) == torch_paged


# --- memory and device index (a fake accelerator module) ------------------------------------


@pytest.fixture
def fake_card(monkeypatch):
    module = SimpleNamespace(
        device_count=lambda: 2,
        mem_get_info=lambda device: (60 * GIB, 80 * GIB),
        set_device=lambda index: None,
    )
    monkeypatch.setattr(torch, "fakedev", module, raising=False)
    return dataclasses.replace(
        MLU_PLATFORM,
        name="fake",
        torch_device="fakedev",
        visible_devices_env="FAKE_VISIBLE_DEVICES",
    )


def test_kv_cache_budget(fake_card):
    assert CPU_PLATFORM.kv_cache_bytes(None, 0.9, torch.device("cpu")) == 2 * GIB
    assert CPU_PLATFORM.kv_cache_bytes(0.5, 0.9, torch.device("cpu")) == 0.5 * GIB
    # 0.9 of 80 GiB is 72; 20 GiB are in use, so 52 GiB are left for the cache
    assert fake_card.kv_cache_bytes(None, 0.9, None) == pytest.approx(52 * GIB)
    assert fake_card.kv_cache_bytes(3.0, 0.9, None) == 3 * GIB
    with pytest.raises(
        ValueError, match="--gpu-memory-utilization: 0.2 of 80.0 GiB leaves nothing"
    ):
        fake_card.kv_cache_bytes(None, 0.2, None)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_each_rank_takes_the_card_at_its_index(fake_card):
    assert [fake_card.device_index(rank) for rank in (0, 1)] == [0, 1]
    with pytest.raises(
        ValueError, match="rank 2 needs card 2 but only 2 are visible.*FAKE_VISIBLE_DEVICES"
    ):
        fake_card.device_index(2)
    assert CPU_PLATFORM.device_index(3) == 0 and CPU_PLATFORM.device(0) == torch.device("cpu")


# --- check-device, end to end on the CPU (compared with itself) ------------------------------


def test_check_device_runs_on_cpu(capsys, tmp_path, hf_gguf_tokenizer):
    """The checks on a tiny random Llama (the default model's tokenizer): the command loads
    four engines (the CPU reference, the device, one per runner), ~30 s on the 135M model."""
    model_dir, _ = build_checkpoint("llama", tmp_path / "tiny-llama", hf_gguf_tokenizer)
    status = main(
        [
            "check-device",
            "--model",
            str(model_dir),
            "--kv-cache-memory",
            "0.05",
            "--device",
            "cpu",
            "--runners",
            "eager,graph",
            "--max-tokens",
            "3",
            "--batch-size",
            "2",
            "--max-model-len",
            "128",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "logits  PASS: float32 cpu vs cpu, max |diff| 0.00e+00" in out
    assert "eager   PASS" in out and "tok/s" in out
    assert (
        "graph   PASS: greedy tokens equal eager's" in out
    )  # TorchScript-traced decode steps on the CPU
    assert "all checks passed" in out


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_kv_tensors_are_zero_and_resident_only_where_written():
    platform = cpu.load()
    shapes = [(64, 16, 4, 64), (64, 16, 4, 64), (3, 5)]  # 1 MiB each in float32, and a small one
    before = _resident_kib()
    tensors = platform.zeros(shapes * 32, torch.float32, torch.device("cpu"))
    assert [tuple(t.shape) for t in tensors] == shapes * 32
    assert all(t.dtype == torch.float32 and not t.any() for t in tensors[:3])
    # reading zero pages maps the kernel's shared zero page: still nothing resident
    assert _resident_kib() - before < 16 * 1024  # 64 MiB allocated, then read
    tensors[0][0].fill_(1.0)  # a block of one layer: a few pages
    assert tensors[0][0].eq(1).all() and not tensors[0][1:].any() and not tensors[1].any()
    assert _resident_kib() - before < 16 * 1024
    tensors[-2].fill_(2.0)  # the tensors do not overlap
    assert tensors[-2].eq(2).all() and not tensors[-3].any() and not tensors[-1].any()
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE): Linux")
def test_cpu_weights_move_to_one_huge_page_mapping_keeping_identity_and_values(monkeypatch):
    """Weights move into one mapping advised for huge pages: each tensor object is the same (a
    tied embedding holding the LM head's buffer follows), its values equal, the first on a
    2 MiB boundary, and the old bytes freed, a packed weight's reshaped base included."""
    monkeypatch.setenv(interface.HUGE_PAGES_ENV, "1")
    platform = cpu.load()
    module = torch.nn.Module()
    module.register_buffer(
        "packed", torch.randint(0, 255, (64, 32, 64), dtype=torch.uint8).view(64, -1)
    )
    module.weight = torch.nn.Parameter(torch.randn(256, 256), requires_grad=False)
    module.register_buffer("small", torch.randn(8))  # below the size worth a move: left alone
    aliases = [module.packed, module.weight]  # what other objects hold
    expected = [t.clone() for t in (module.packed, module.weight, module.small)]
    small_ptr = module.small.data_ptr()
    base = module.packed._base
    platform.place_weights([module.packed, module.weight, module.small])
    assert aliases[0] is module.packed and aliases[1] is module.weight
    for tensor, value in zip((module.packed, module.weight, module.small), expected):
        assert torch.equal(tensor, value)
    mapping = module.packed.untyped_storage()
    assert module.weight.untyped_storage().data_ptr() == mapping.data_ptr()
    assert module.packed.data_ptr() % interface.HUGE_PAGE_BYTES == 0
    assert base.data_ptr() == module.packed.data_ptr()  # the base no longer holds the old bytes
    assert module.small.data_ptr() == small_ptr


def test_huge_pages_leave_the_default_models_tokens_and_logprobs_as_they_were(monkeypatch):
    """The default model (GGUF weights as stored, bfloat16) in huge pages or not: the same
    greedy tokens and logprobs, and its weights all in one mapping (the suite runs without)."""
    from pyxllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    kwargs = dict(quantization="gguf", dtype="bfloat16", max_model_len=128, kv_cache_memory=0.05)
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(interface.HUGE_PAGES_ENV, setting)
        llm = LLM(**kwargs)
        output = llm.generate(["The capital of France is"], params)[0].outputs[0]
        outputs[setting] = (output.token_ids, [sorted(e.items()) for e in output.logprobs])
        model = llm.llm_engine.executor.driver.model
        storages = {
            m.qweight.untyped_storage().data_ptr() for m in model.modules() if hasattr(m, "qweight")
        }
        assert (len(storages) == 1) == (setting == "1")
    assert outputs["1"] == outputs["0"]
