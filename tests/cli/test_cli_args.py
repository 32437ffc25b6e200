"""The ``pyxllm`` command line: flag spellings, booleans, errors, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import types

import pytest

from pyxllm.cli.engine_args import add_engine_args, config_from_args
from pyxllm.cli.main import main, make_arg_parser, parse_args
from pyxllm.config import EngineConfig
from pyxllm.engine.input_processor import InputProcessor
from pyxllm.entrypoints.flags import flag_names
from pyxllm.entrypoints.openai.server_options import RequestLimits, ServerOptions
from pyxllm.flag_fields import from_namespace, keyword_aliases
from pyxllm.outputs import CompletionOutput, RequestOutput
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


def parse(*argv: str):
    """Parse ``pyxllm serve <argv>`` and return the config."""
    return parse_args(["serve", *argv])[1]


def expect_usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    return err


# --- spellings -----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dash", "underscore", "dash=", "underscore="])
@pytest.mark.parametrize(
    "field, text, value",
    [
        ("max_seqs_per_batch", "8", 8),
        ("max_tokens_per_batch", "512", 512),
        ("max_model_len", "1024", 1024),
        ("block_size", "32", 32),
        ("kv_cache_memory", "0.5", 0.5),
        ("served_model_name", "my-model", ("my-model",)),
        ("dtype", "bfloat16", "bfloat16"),
        ("seed", "-3", -3),
    ],
)
def test_every_spelling_sets_the_field(form, field, text, value):
    dashed, underscored = "--" + field.replace("_", "-"), "--" + field
    name = dashed if form.startswith("dash") else underscored
    argv = [f"{name}={text}"] if form.endswith("=") else [name, text]
    config = parse(*argv)
    assert getattr(config, field) == value
    assert type(getattr(config, field)) is type(value)


def test_every_config_field_is_a_flag_in_both_spellings():
    parser = make_arg_parser().command_parsers["serve"]
    known = set(parser._option_string_actions)
    for field in dataclasses.fields(EngineConfig):
        for name in flag_names(field.name):
            assert name in known, name


def test_a_new_dataclass_field_becomes_a_flag_without_edits():
    @dataclasses.dataclass
    class Extended:
        tensor_parallel_size: int = 1
        enable_prefix_cache: bool = False
        gpu_fraction: float | None = None

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(parser, Extended)
    ns = parser.parse_args(
        ["--tensor_parallel_size=2", "--enable-prefix-cache", "--gpu-fraction", "0.9"]
    )
    assert (ns.tensor_parallel_size, ns.enable_prefix_cache, ns.gpu_fraction) == (2, True, 0.9)
    assert parser.parse_args([]).gpu_fraction is None


def test_vllm_spellings_of_scheduler_cache_and_quantization_flags():
    config = parse(
        *("--max-num-seqs", "8", "--max_num_batched_tokens", "512"),
        *("--no-enable-prefix-caching", "--quantization", "none"),
    )
    assert (config.max_seqs_per_batch, config.max_tokens_per_batch) == (8, 512)
    assert config.enable_prefix_cache is False and config.quantization is None
    assert parse("--enable_prefix_caching=true").enable_prefix_cache is True
    assert EngineConfig(quantization="none").quantization is None


def test_max_model_len_auto_means_none():
    assert parse("--max-model-len", "2048").max_model_len == 2048
    assert parse("--max-model-len", "auto").max_model_len is None


def test_defaults_equal_engine_config_defaults():
    assert parse() == EngineConfig()
    args, config = parse_args(["generate", "hi"])
    assert config == EngineConfig()
    assert (args.prompt, args.chat, args.max_tokens) == ("hi", True, 256)
    serve_args, _ = parse_args(["serve"])
    assert (serve_args.host, serve_args.port) == ("127.0.0.1", 8000)


def test_server_options_are_the_serve_flags_field_by_field(monkeypatch):
    """ServerOptions is built from the parsed serve flags by its fields' metadata: the flags'
    defaults are its defaults, and each flag reaches its field (the inverted --disable-x ones,
    the -1 and none sentinels, the nested request limits, lists as tuples)."""
    monkeypatch.delenv("PYXLLM_API_KEY", raising=False)
    assert from_namespace(ServerOptions, parse_args(["serve"])[0]) == ServerOptions()
    args, _ = parse_args(
        [
            *("serve", "--disable-web-ui", "--disable-uvicorn-access-log", "--disable-log-stats"),
            *("--uvicorn-log-level", "info", "--max-n", "3", "--max-request-body-bytes", "100"),
            *("--allowed-origins", "a,b", "--reasoning-parser", "qwen3", "--reasoning-budget"),
            *("5", "--api-key", "k1,k2", "-dp", "2", "--max-log-len", "none", "--port", "9"),
        ]
    )
    assert from_namespace(ServerOptions, args) == ServerOptions(
        port=9,
        web_ui=False,
        access_log=False,
        stats_interval=None,
        log_level="info",
        limits=RequestLimits(max_n=3, max_request_body_bytes=100),
        allowed_origins=("a", "b"),
        reasoning_parser="qwen3",
        reasoning_budget=5,
        api_keys=("k1", "k2"),
        data_parallel_size=2,
    )


def test_vllm_field_names_are_flags_and_keywords_from_the_metadata():
    assert keyword_aliases(EngineConfig) == {
        "max_num_seqs": "max_seqs_per_batch",
        "max_num_batched_tokens": "max_tokens_per_batch",
        "enable_prefix_caching": "enable_prefix_cache",
        "master_node_addr": "master_addr",
    }
    assert EngineConfig.from_kwargs(max_num_seqs=8).max_seqs_per_batch == 8
    with pytest.raises(TypeError, match="give one of them"):
        EngineConfig.from_kwargs(max_num_seqs=8, max_seqs_per_batch=4)


def test_keywords_take_their_flags_text_and_a_misspelt_one_names_the_closest():
    """``LLM(...)`` takes every flag as a keyword: a number's text is read as its flag reads
    it (``kv_cache_memory_bytes="1G"`` raised a TypeError comparing a str with 0), a text the
    flag refuses names the flag, and an unknown keyword names the closest known one."""
    config = EngineConfig.from_kwargs(
        kv_cache_memory_bytes="1G", max_num_seqs="8", max_model_len="2048", seed="-3"
    )
    assert (config.kv_cache_memory, config.max_seqs_per_batch) == (1.0, 8)
    assert (config.max_model_len, config.seed) == (2048, -3)
    assert EngineConfig.from_kwargs(kv_cache_memory="0.5").kv_cache_memory == 0.5
    assert EngineConfig.from_kwargs(dtype="float32").dtype == "float32"  # text fields as given
    for kwargs, message in [
        ({"kv_cache_memory_bytes": "1.5G"}, "--kv-cache-memory-bytes: cannot read '1.5G'"),
        ({"max_model_len": "long"}, "--max-model-len: cannot read 'long'"),
        ({"kv_cache_memory": "nan"}, "--kv-cache-memory: cannot read 'nan'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineConfig.from_kwargs(**kwargs)
    with pytest.raises(TypeError, match=r"'max_model_lenn' \(did you mean 'max_model_len'\?\)"):
        EngineConfig.from_kwargs(max_model_lenn=10)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'flux_capacitor'$"):
        EngineConfig.from_kwargs(flux_capacitor=1)


# --- booleans ------------------------------------------------------------------------------

BOOL_CASES = [
    ([], True),
    (["--enable-chunked-prefill"], True),
    (["--enable_chunked_prefill"], True),
    (["--no-enable-chunked-prefill"], False),
    (["--no_enable_chunked_prefill"], False),
    (["--enable-chunked-prefill=false"], False),
    (["--enable-chunked-prefill", "false"], False),
    (["--enable_chunked_prefill", "False"], False),
    (["--enable-chunked-prefill=true"], True),
    (["--enable-chunked-prefill", "true"], True),
    (["--enable-chunked-prefill=0"], False),
    (["--enable-chunked-prefill=1"], True),
    (["--enable-chunked-prefill", "no"], False),
    (["--enable-chunked-prefill", "yes"], True),
    (["--enable-chunked-prefill", "off"], False),
    (["--no-enable-chunked-prefill", "--enable-chunked-prefill"], True),
    (["--enable-chunked-prefill", "false", "--block-size", "8"], False),
]


@pytest.mark.parametrize("argv, value", BOOL_CASES)
def test_bool_spellings(argv, value):
    config = parse(*argv)
    assert config.enable_chunked_prefill is value


@pytest.mark.parametrize(
    "argv, value",
    [
        (["--no-chat"], False),
        (["--chat", "false"], False),
        (["--chat=0"], False),
        (["--chat"], True),
        (["--chat", "yes"], True),
        ([], True),
    ],
)
def test_generate_chat_flag(argv, value):
    args, _ = parse_args(["generate", "a prompt", *argv])
    assert args.chat is value
    assert args.prompt == "a prompt"


@pytest.mark.parametrize(
    "bad",
    [
        ["--enable-chunked-prefill", "maybe"],
        ["--enable-chunked-prefill=maybe"],
        ["--enable_chunked_prefill="],
    ],
)
def test_bad_bool_names_flag_and_accepted_values(capsys, bad):
    err = expect_usage_error(capsys, ["serve", *bad])
    assert "--enable-chunked-prefill" in err
    assert "true" in err and "false" in err


def test_no_flag_takes_no_value(capsys):
    err = expect_usage_error(capsys, ["serve", "--no-enable-chunked-prefill", "false"])
    assert "MODEL 'false': neither a path that exists nor a Hugging Face model id" in err


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--block-size", "abc"], "--block-size"),
        (["--block_size=abc"], "--block-size"),
        (["--max-seqs-per-batch", "2.5"], "--max-seqs-per-batch"),
        (["--dtype", "int3"], "--dtype"),
        (["--kv-cache-memory", "-1"], "--kv-cache-memory"),
        (["--kv-cache-memory", "nan"], "--kv-cache-memory"),
        (["--block-size", "0"], "--block-size"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--port", "70000"], "--port"),
    ],
)
def test_bad_value_is_a_usage_error_naming_the_flag(capsys, argv, needle):
    err = expect_usage_error(capsys, ["serve", *argv])
    assert needle in err
    assert "pyxllm serve: error:" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-offload-max-gib", "1"], "--kv-offload-max-gib: needs --kv-offload-dir"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating: needs --enable-lora"),
        (["--lora-modules", "a=/x"], "--lora-modules: needs --enable-lora"),
    ],
)
def test_a_flag_without_the_one_it_needs_is_refused(capsys, argv, message):
    """It used to start a server on which the flag did nothing."""
    assert message in expect_usage_error(capsys, ["serve", *argv])


def test_a_kv_offload_dir_that_is_a_file_is_refused_before_loading(capsys, tmp_path):
    """It loaded the model, then died in a traceback (NotADirectoryError)."""
    path = tmp_path / "file"
    path.write_text("")
    err = expect_usage_error(capsys, ["serve", "--kv-offload-dir", str(path)])
    assert f"--kv-offload-dir {path}: not a directory" in err


def test_run_batch_names_a_missing_input_or_output_directory(capsys, tmp_path):
    """Before the model loads, naming the flag (it printed ``error: [Errno 2] ...``)."""
    given = tmp_path / "in.jsonl"
    given.write_text("")
    missing = tmp_path / "none.jsonl"
    err = expect_usage_error(capsys, ["run-batch", "-i", str(missing), "-o", "out.jsonl"])
    assert f"--input-file {missing}: no such file" in err
    out = tmp_path / "nodir" / "out.jsonl"
    err = expect_usage_error(capsys, ["run-batch", "-i", str(given), "-o", str(out)])
    assert f"--output-file {out}: no directory {out.parent}" in err


def test_no_prefix_abbreviations(capsys):
    err = expect_usage_error(capsys, ["serve", "--max-seqs", "4"])
    assert "unrecognized arguments" in err


@pytest.mark.parametrize(
    "argv, command, hint",
    [
        (["serve", "--prot", "8001"], "pyxllm serve", "--prot: did you mean --port?"),
        (["generate", "hi", "--temprature", "0"], "pyxllm generate", "did you mean --temperature?"),
        (["bench", "latency", "--input-lenn", "8"], "pyxllm bench latency", "--input-len?"),
        (["chat", "--bogus"], "pyxllm chat", None),
    ],
)
def test_an_unknown_flag_is_named_by_its_subcommand_with_the_closest_flag(
    capsys, argv, command, hint
):
    """argparse names an unknown flag from the top parser (``pyxllm: error:``, with ``pyxllm``'s
    usage); the subcommand's parser reports it instead, with the closest of its own flags."""
    err = expect_usage_error(capsys, argv)
    assert f"{command}: error: unrecognized arguments: {argv[-2 if hint else -1]}" in err
    assert f"usage: {command}" in err
    if hint is None:
        assert "did you mean" not in err
    else:
        assert hint in err


@pytest.mark.parametrize(
    "argv, prog, words, error",
    [
        (
            ["serve", "--port", "abc"],
            "pyxllm serve",
            "[MODEL] [flags]",
            "argument --port: invalid port 'abc': must be an integer in 0..65535",
        ),
        (
            ["run-batch"],
            "pyxllm run-batch",
            "-i PATH -o PATH [flags]",
            "the following arguments are required: -i/--input-file",
        ),
        (
            ["bench", "throughput", "--bogus"],
            "pyxllm bench throughput",
            "[flags]",
            "unrecognized arguments: --bogus",
        ),
    ],
)
def test_a_usage_error_shows_one_usage_line_where_the_flags_are_many(
    capsys, argv, prog, words, error
):
    """``serve``'s automatic usage listed every flag over 70 lines before the error; a command
    with that many flags shows one line (``--help`` still lists them all), as vLLM's."""
    err = expect_usage_error(capsys, argv)
    first, second = err.splitlines()
    assert first == f"usage: {prog} {words}"
    assert second.startswith(f"{prog}: error: {error}")


def test_config_from_args_raises_value_error_naming_the_flag():
    ns = make_arg_parser().parse_args(["serve", "--kv-cache-memory", "0"])
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        config_from_args(ns)


def test_command_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


# --- help ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["run-batch", "--help"]]
)
def test_help_lists_flags(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-seqs-per-batch" in out
    assert "--no-enable-chunked-prefill" in out
    if argv[0] == "serve":
        assert "--port" in out and "--host" in out
    if argv[0] == "run-batch":  # its own flags and serve's response flags
        assert "--input-file" in out and "--max-concurrency" in out
        assert "--reasoning-parser" in out and "--port" not in out


# --- commands (engine and server replaced; the real path is the subprocess test below) -----


def test_serve_calls_run_server(monkeypatch):
    calls = []
    fake = types.ModuleType("pyxllm.entrypoints.openai.api_server")
    fake.run_server = lambda config, options: calls.append(
        (config, options.host, options.port, options.reasoning_parser)
    )
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert main(["serve", "--port", "9001", "--host=0.0.0.0", "--max_seqs_per_batch", "4"]) == 0
    assert main(["serve", "--reasoning-parser", "qwen3"]) == 0
    assert calls == [
        (dataclasses.replace(EngineConfig(), max_seqs_per_batch=4), "0.0.0.0", 9001, None),
        (EngineConfig(), "127.0.0.1", 8000, "qwen3"),
    ]


def test_model_load_error_prints_message_not_traceback(monkeypatch, capsys):
    fake = types.ModuleType("pyxllm.entrypoints.openai.api_server")

    def run_server(config, options):
        raise ValueError(f"model {config.model!r}: not a .gguf file or model directory")

    fake.run_server = run_server
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.delenv("PYXLLM_DEBUG", raising=False)
    assert main(["serve", "--model", "/nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model '/nope'")
    assert "Traceback" not in err


class FakeEngine:
    """Stands in for LLMEngine to check the CLI's streaming (a real input processor over a fake
    tokenizer, a model whose generation_config sets three defaults); yields text in three
    pieces."""

    pieces = ["The capital", " of France", " is Paris."]
    generation_defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}

    def __init__(self, config):
        self.requests, self.stepped = [], 0
        tokenizer = types.SimpleNamespace(
            encode=lambda text, add_special_tokens=True: [1, 2, 3],
            apply_chat_template=lambda messages, add_generation_prompt=True: [9, 9, 9, 9],
        )
        self.input_processor = InputProcessor(
            tokenizer,
            vocab_size=10,
            max_model_len=512,
            max_kv_blocks=32,
            block_size=16,
            generation_defaults=self.generation_defaults,
        )
        FakeEngine.last = self

    def add_request(self, request):
        self.requests.append(request)

    def shutdown(self):
        pass

    def has_unfinished_requests(self):
        return self.stepped < len(self.pieces)

    def step(self):
        self.stepped += 1
        text = "".join(self.pieces[: self.stepped])
        done = self.stepped == len(self.pieces)
        out = CompletionOutput(0, text, list(range(self.stepped)), "stop" if done else None)
        request = self.requests[0]
        return [RequestOutput(request.request_id, request.prompt, [], [out], done)]


@pytest.mark.parametrize("chat, ids", [(True, [9, 9, 9, 9]), (False, [1, 2, 3])])
def test_generate_streams_cumulative_text_once(monkeypatch, capsys, chat, ids):
    fake = types.ModuleType("pyxllm.engine.llm_engine")
    fake.LLMEngine = FakeEngine
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    flag = "--chat" if chat else "--no-chat"
    assert main(["generate", "Capital?", flag, "--temperature", "0", "--max-tokens", "7"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"
    (request,) = FakeEngine.last.requests
    assert request.prompt_token_ids == ids and request.prompt == (None if chat else "Capital?")
    params = request.sampling_params
    assert (params.temperature, params.max_tokens) == (0.0, 7)
    # not given: the model's generation_config defaults, all of them
    assert (params.top_k, params.repetition_penalty) == (20, 1.1)


def test_generate_takes_unset_sampling_flags_from_the_model(monkeypatch, capsys):
    fake = types.ModuleType("pyxllm.engine.llm_engine")
    fake.LLMEngine = FakeEngine
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert main(["generate", "Capital?", "--top_p=0.5"]) == 0
    params = FakeEngine.last.requests[0].sampling_params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)


def test_generate_bad_sampling_value_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--top-p", "1.5"])
    assert exc.value.code == 2
    assert "--top-p" in capsys.readouterr().err


def _engine_exists() -> bool:
    return (ROOT / "pyxllm" / "engine" / "llm_engine.py").exists()


@pytest.mark.skipif(not _engine_exists(), reason="pyxllm/engine/llm_engine.py not written yet")
def test_generate_end_to_end_subprocess():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyxllm",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert proc.stdout.endswith("\n")


# --- vLLM's flags and keywords (issue 20) ---------------------------------------------------


def test_several_served_model_names():
    assert parse("--served-model-name", "a", "b").served_model_name == ("a", "b")
    assert parse("--served_model_name=only").served_model_names == ("only",)
    assert EngineConfig(served_model_name="one").served_model_name == ("one",)
    assert EngineConfig().served_model_names == ()


def test_served_model_name_needs_a_name(capsys):
    err = expect_usage_error(capsys, ["serve", "--served-model-name"])
    assert "--served-model-name" in err


@pytest.mark.parametrize(
    "text, gib",
    [
        ("1073741824", 1.0),
        ("512M", 0.5),
        ("2G", 2.0),
        ("1.5g", 1.5e9 / 2**30),
        ("250m", 250e6 / 2**30),
    ],
)
def test_kv_cache_memory_bytes_is_vllms_size_in_bytes(text, gib):
    assert parse("--kv-cache-memory-bytes", text).kv_cache_memory == pytest.approx(gib)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--kv-cache-memory-bytes", "1.5G"], "decimals go with the decimal suffixes"),
        (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
        (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes: must be > 0"),
        (
            ["--kv-cache-memory-bytes", "1G", "--kv-cache-memory", "1"],
            "--kv-cache-memory-bytes: give it or --kv-cache-memory (GiB), not both",
        ),
    ],
)
def test_bad_kv_cache_memory_bytes_is_a_usage_error(capsys, argv, needle):
    assert needle in expect_usage_error(capsys, ["serve", *argv])


def test_llm_takes_vllms_keyword_names(monkeypatch):
    """``LLM(...)`` reads vLLM's keywords as the flags do (the engine is replaced: only the
    config it gets matters here)."""
    from pyxllm.entrypoints import llm as llm_module

    monkeypatch.setattr(llm_module, "LLMEngine", lambda config: config)
    config = llm_module.LLM(
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=2**29,
        served_model_name=["a", "b"],
    ).llm_engine
    assert (config.enable_prefix_cache, config.max_seqs_per_batch) == (False, 4)
    assert (config.max_tokens_per_batch, config.kv_cache_memory) == (256, 0.5)
    assert config.served_model_name == ("a", "b")
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        llm_module.LLM(enable_prefix_caching=True, enable_prefix_cache=True)
    with pytest.raises(TypeError, match="no_such_setting"):
        llm_module.LLM(no_such_setting=1)


def test_chunked_prefill_off_raises_the_default_budget_to_max_model_len():
    from pyxllm.engine.kv_cache_manager import KVCacheManager
    from pyxllm.engine.scheduler import Scheduler

    off = parse("--no-enable-chunked-prefill")
    assert off.max_tokens_per_batch is None
    assert (off.token_budget(8192), off.token_budget(1024)) == (8192, 2048)
    assert parse().token_budget(8192) == 2048
    given = parse("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert given.token_budget(8192) == 4096  # an explicit budget is kept (and then refused)
    # the scheduler takes the whole long prompt in one step
    scheduler = Scheduler(off, KVCacheManager(num_blocks=256, block_size=16), max_model_len=3000)
    request = _request("long", list(range(1, 2901)))
    scheduler.add_request(request)
    (sequence,) = scheduler.schedule().sequences
    assert len(sequence.token_ids) == 2900


def _request(request_id: str, prompt_token_ids: list[int]):
    from pyxllm.engine.detokenizer import IncrementalDetokenizer
    from pyxllm.engine.request import Request
    from pyxllm.sampling_params import SamplingParams

    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
    return Request(request_id, None, prompt_token_ids, SamplingParams(max_tokens=1), detokenizer)


def test_generation_config_modes(tmp_path, capsys):
    from pyxllm.weights import load_generation_defaults
    from pyxllm.weights.source import ModelSource

    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    (model / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_k": 20, "eos_token_id": [2, 7]}'
    )
    (other / "generation_config.json").write_text(
        '{"temperature": 0.3, "max_new_tokens": 9, "eos_token_id": 5}'
    )
    source, config = ModelSource("hf", model, "model"), types.SimpleNamespace(eos_token_id=2)
    auto = load_generation_defaults(source, config, "auto")
    assert (auto.sampling, auto.eos_token_ids) == ({"temperature": 0.6, "top_k": 20}, (2, 7))
    vllm = load_generation_defaults(source, config, "vllm")  # no defaults, the same EOS ids
    assert (vllm.sampling, vllm.eos_token_ids) == ({}, (2, 7))
    folder = load_generation_defaults(source, config, str(other))
    assert (folder.sampling, folder.eos_token_ids) == (
        {"temperature": 0.3, "max_tokens": 9},
        (2, 5),
    )
    assert parse().generation_config == "auto"
    assert parse("--generation-config", "vllm").generation_config == "vllm"
    assert parse("--generation-config", str(other)).generation_config == str(other)
    err = expect_usage_error(capsys, ["serve", "--generation-config", str(tmp_path)])
    assert "--generation-config: " in err and "generation_config.json" in err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path, capsys):
    from pyxllm.config import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}\n")
    assert parse("--chat-template", str(path)).chat_template == str(path)
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}\n"
    literal = "{% for m in messages %}{{ m.content }}\\n{% endfor %}"  # as a shell passes it
    assert parse("--chat-template", literal).chat_template == literal
    assert load_chat_template(literal) == "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert load_chat_template(None) is None
    err = expect_usage_error(capsys, ["serve", "--chat-template", str(tmp_path / "nope.jinja")])
    assert "--chat-template: " in err and "looks like a file path" in err


def test_server_logging_and_proxy_flags():
    args, _ = parse_args(
        [
            *("serve", "--root-path", "/api", "--enable-log-requests", "--max-log-len", "80"),
            "--enable-prompt-tokens-details",
        ]
    )
    assert (args.root_path, args.enable_log_requests, args.max_log_len) == ("/api", True, 80)
    assert args.enable_prompt_tokens_details is True
    defaults, _ = parse_args(["serve"])
    assert (defaults.root_path, defaults.enable_log_requests, defaults.max_log_len) == (
        "",
        False,
        None,
    )
    assert defaults.enable_prompt_tokens_details is False


def test_serve_help_groups_flags_as_vllm_does(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    titles = [line[:-1] for line in out.splitlines() if line.endswith(" flags:")]
    assert titles == [
        "server flags",
        "security flags",
        "limits and shutdown flags",
        "logging flags",
        "model flags",
        "cache flags",
        "scheduler flags",
        "parallel flags",
        "device flags",
        "decoding flags",
        "LoRA flags",
    ]
    scheduler = out[out.index("scheduler flags:") : out.index("parallel flags:")]
    assert "--max-num-seqs" in scheduler and "--max-num-batched-tokens" in scheduler


# --- docs/cli.md's flag tables are the parser's ---------------------------------------------


@pytest.mark.parametrize("command", ["serve", "disagg-proxy"])
def test_cli_doc_flag_tables_are_written_from_the_parser(command):
    from pyxllm.cli.flag_tables import DOCUMENTED, command_tables, readme_section

    assert command in DOCUMENTED
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert readme_section(page, command) == command_tables(command), (
        f"docs/cli.md's flag tables differ from `pyxllm {command} --help`; rewrite them with "
        "`.venv/bin/python -m pyxllm.cli.flag_tables docs/cli.md`"
    )


def test_every_cli_doc_flag_row_is_a_flag_and_every_flag_has_a_row():
    import re

    from pyxllm.cli.flag_tables import readme_section

    section = readme_section((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    in_doc = {name for row in rows for name in re.findall(r"`(--[\w-]+)`", row.split("|")[1])}
    parser = make_arg_parser().command_parsers["serve"]
    options = parser._option_string_actions
    assert in_doc <= set(options)
    primary = {
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and action.help
        and not action.help.startswith("same as --")
        and action.option_strings[0] != "-h"
    }
    assert primary <= in_doc, sorted(primary - in_doc)
    # the two a new user found apart: --seed's meaning, --dist-init-timeout's row
    seed = next(row for row in rows if row.startswith("| `--seed`"))
    assert options["--seed"].help in seed
    assert any(row.startswith("| `--dist-init-timeout`") for row in rows)


def test_lora_modules_take_pairs_by_spaces_commas_repeats_or_json():
    """vLLM's ``--lora-modules a=DIR1 b=DIR2`` (docs/lora.md's first line) was refused as an
    unrecognized argument; commas, repeats and JSON objects still work, in any mix."""

    def modules(*values):
        args, _ = parse_args(["serve", "--enable-lora", *values])
        return [(m["name"], m["path"]) for m in from_namespace(ServerOptions, args).lora_modules]

    assert modules("--lora-modules", "a=/x", "b=/y") == [("a", "/x"), ("b", "/y")]
    assert modules("--lora-modules", "a=/x,b=/y", "--lora-modules", "c=/z") == [
        ("a", "/x"),
        ("b", "/y"),
        ("c", "/z"),
    ]
    assert modules("--lora-modules", '{"name": "j", "path": "/p"}', "k=/q") == [
        ("j", "/p"),
        ("k", "/q"),
    ]
