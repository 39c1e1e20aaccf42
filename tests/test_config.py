"""Config: sizes and durations are parsed once, when a config is built; the CLI takes the same strings."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.cli import build_parser
from deepinfer.cluster.launcher import engine_flags
from deepinfer.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    LimitsConfig,
    ModelConfig,
    ServerConfig,
    engine_config_from_args,
    parse_duration,
    parse_size,
    resolve_size,
)

GiB, MiB = 2**30, 2**20


def test_parse_size():
    assert parse_size("2GiB") == 2 * GiB and parse_size(" 512 MiB ") == 512 * MiB and parse_size("1.5k") == 1536
    assert parse_size("512MB") == 512 * 10**6 and parse_size("1000000") == 10**6 and parse_size("1e9") == 10**9
    # a bare number <= 1 (text or float) is a fraction of a total known at run time; an int is bytes
    assert parse_size("0.25") == 0.25 and isinstance(parse_size("1"), float) and parse_size(0.5) == 0.5
    assert parse_size(4096) == 4096 and parse_size(1) == 1 and isinstance(parse_size(1), int)
    assert parse_size(2.0) == 2 and isinstance(parse_size(2.0), int)
    assert parse_size("0.5", fractions=False) == 0
    assert parse_size("auto", auto=True) is None and parse_size(None, auto=True) is None
    for bad in ("lots", "-1", "-1GiB", "inf", "nan", "2xb", "", "auto", None, True, -3, float("nan")):
        with pytest.raises(ValueError, match="cannot parse size"):
            parse_size(bad)
    for parsed in (2 * GiB, 0.25, 0.0, 1):  # parsed values parse to themselves
        assert parse_size(parsed) == parsed and type(parse_size(parsed)) is type(parsed)
    assert resolve_size(0.25, 1000) == 250 and resolve_size(3 * MiB, 1000) == 3 * MiB


def test_parse_duration():
    assert parse_duration("90s") == 90 and parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400
    assert parse_duration("7d") == 7 * 86400 and parse_duration("42") == 42
    with pytest.raises(ValueError, match="cannot parse duration"):
        parse_duration("7days")


def test_configs_hold_numbers():
    cache = CacheConfig()
    assert cache.kv_cache_memory is None  # auto: decided from the hardware by the runner
    assert CacheConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 * MiB
    assert CacheConfig(kv_cache_memory="0.3").kv_cache_memory == 0.3
    kv = KVStoreConfig()
    assert kv.host_cache_memory == 0 and kv.kv_store_max_bytes == 20 * GiB
    assert kv.retention.ttls == {"agent": 72 * 3600, "chat": 7 * 86400} and kv.retention.default_class == "chat"
    assert KVStoreConfig(kv_retention="batch=90m", default_retention_class="batch").retention.ttl(None) == 5400
    assert LimitsConfig().max_request_body_size == 16 * MiB
    with pytest.raises(ValueError, match="at least 1KiB"):
        LimitsConfig(max_request_body_size="0.5")
    with pytest.raises(ValueError, match="cannot parse size"):
        CacheConfig(kv_cache_memory="lots")
    # rebuilt from parsed values (dataclasses.replace) the numbers stay
    again = dataclasses.replace(kv, kv_store_prefetch=False)
    assert again.kv_store_max_bytes == 20 * GiB and again.retention == kv.retention
    assert dataclasses.replace(cache, block_size=32).kv_cache_memory is None
    cfg = EngineConfig.from_kwargs(kv_cache_memory="256MiB", host_cache_memory=0.1)
    assert cfg.cache.kv_cache_memory == 256 * MiB and cfg.kvstore.host_cache_memory == 0.1
    with pytest.raises(TypeError, match="unknown engine argument 'retention'"):
        EngineConfig.from_kwargs(retention=None)  # derived, not an argument


def test_cli_takes_the_same_strings_and_help_is_unchanged():
    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-memory", "512MiB", "--host-cache-memory", "0.1",
                              "--kv-store-max-bytes", "1GiB", "--kv-retention", "agent=1h,chat=2h",
                              "--max-request-body-size", "1MiB"])
    engine = engine_config_from_args(args)
    assert engine.cache.kv_cache_memory == 512 * MiB and engine.kvstore.host_cache_memory == 0.1
    assert engine.kvstore.kv_store_max_bytes == GiB
    assert engine.kvstore.retention.ttls == {"agent": 3600, "chat": 7200}
    from deepinfer.cli import _server_config

    assert _server_config(args).limits.max_request_body_size == MiB
    assert engine_config_from_args(parser.parse_args(["serve"])).cache.kv_cache_memory is None
    # worker processes get the parsed values back as flags and parse them to the same numbers
    rebuilt = engine_config_from_args(parser.parse_args(["serve", *engine_flags(engine)]))
    assert rebuilt == engine and rebuilt.kvstore.retention == engine.kvstore.retention
    # --speculative-config goes to decode workers as JSON, not to prefill workers
    spec = parser.parse_args(["serve", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    spec_engine = engine_config_from_args(spec)
    assert engine_config_from_args(parser.parse_args(["serve", *engine_flags(spec_engine, "decode")])) == spec_engine
    prefill = engine_config_from_args(parser.parse_args(["serve", *engine_flags(spec_engine, "prefill")]))
    assert prefill.speculative.speculative_config is None
    # --help shows the text defaults, as before; the flags take strings
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt: action for action in serve._actions for opt in action.option_strings}
    for flag, default in (("--kv-cache-memory", "auto"), ("--host-cache-memory", "0"),
                          ("--kv-store-max-bytes", "20GiB"), ("--max-request-body-size", "16MiB"),
                          ("--kv-retention", "agent=72h,chat=7d")):
        assert flags[flag].help.endswith(f"(default: {default})") and flags[flag].type is str, flag
    assert isinstance(ServerConfig().limits.max_request_body_size, int)


def test_vllm_serve_command_lines(capsys):
    """A `vllm serve` line: the model positional, vLLM's names of deepinfer's flags, flags for what deepinfer
    always does, and flags that only take the one value deepinfer supports (else an error naming the flag)."""
    from deepinfer.cli import main
    from deepinfer.vllm_cli import apply_vllm_arguments

    parser = build_parser()
    args = parser.parse_args(["serve", "--port", "8001", "/models/x.gguf", "--tool-call-parser", "llama3_json",
                              "--enable-auto-tool-choice", "--trust-remote-code", "--enforce-eager", "-tp", "1",
                              "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto", "--enable-chunked-prefill",
                              "--gpu-memory-utilization", "0.9", "--disable-log-requests", "--disable-log-stats"])
    notes = apply_vllm_arguments(args)
    assert args.model == "/models/x.gguf" and args.tool_parser == "llama3_json" and args.port == 8001
    assert len(notes) == 1 and "kv_cache_memory" in notes[0]
    assert engine_config_from_args(args).model.model == "/models/x.gguf"
    names = parser.parse_args(["serve", "m.gguf", "--served-model-name", "a", "b"])
    engine = engine_config_from_args(names)
    assert engine.model.served_model_name == ("a", "b")
    assert engine_config_from_args(parser.parse_args(["serve", *engine_flags(engine)])) == engine  # to workers
    assert ModelConfig(served_model_name="one").served_model_name == ("one",)  # the old str form
    for argv, flag in ((["-tp", "2"], "tensor_parallel_size"), (["--pipeline-parallel-size", "2"], "pipeline"),
                       (["--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
                       (["--no-enable-chunked-prefill"], "enable_chunked_prefill"),
                       (["a.gguf", "--model", "b.gguf"], "given twice"),
                       (["--tool-call-parser", "hermes", "--tool-parser", "llama3_json"], "contradicts"),
                       (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
                       (["--limit-mm-per-prompt", '{"audio": 1}'], "only images"),
                       (["--limit-mm-per-prompt", "image=2"], "takes JSON")):
        assert main(["serve", *argv]) == 2, argv  # refused before anything loads
        assert flag in capsys.readouterr().err, argv
    images = parser.parse_args(["serve", "--limit-mm-per-prompt", '{"image": 3}'])
    apply_vllm_arguments(images)
    assert images.max_images_per_request == 3
    assert parser.parse_args(["serve"]).max_images_per_request == 8


def test_cors_origins_take_vllm_json_or_words():
    from deepinfer.config import parse_str_list

    assert parse_str_list('["https://a.example", "http://b:3000"]') == ("https://a.example", "http://b:3000")
    assert parse_str_list("https://a.example, http://b") == ("https://a.example", "http://b")
    assert parse_str_list("none") == () and parse_str_list(("x",)) == ("x",)
    with pytest.raises(ValueError, match="JSON list"):
        parse_str_list('["a", 1]')
    assert ServerConfig().cors_options() == {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"],
                                             "allow_credentials": False}  # vLLM's defaults
    assert ServerConfig(allowed_origins="none").cors_options() is None
    args = build_parser().parse_args(["serve", "--allowed-origins", '["http://a.test"]', "--allow-credentials"])
    from deepinfer.cli import _server_config

    server = _server_config(args)
    assert server.allowed_origins == ("http://a.test",) and server.cors_options()["allow_credentials"] is True
