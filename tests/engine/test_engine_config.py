"""EngineConfig <-> command-line flags: one definition (add_cli_args), one reading (from_cli_args),
and the commands that use them (serve, generate, bench)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Any

import pytest

from backfill.config import EngineConfig
from backfill.entrypoints.cli import _build_parser
from backfill.entrypoints.cli import main as cli_main
from backfill.entrypoints.openai.launcher import main as launcher_main

# A value for every field, each different from its default.
VALUES: dict[str, Any] = {
    "model": "/models/tiny", "policy": "static", "max_num_seqs": 3, "max_num_batched_tokens": 64,
    "num_kv_blocks": 7, "block_size": 8, "max_model_len": 512, "dtype": "bfloat16", "quantization": "int8",
    "device": "cuda:1", "seed": 5, "num_threads": 2, "prefill_budget": 0, "static_padding": False,
    "prepack_weights": False, "enable_prefix_caching": False, "scheduling_policy": "priority",
    "priority_aging_steps": 7, "request_timeout": 2.5, "enforce_eager": True, "activation_quantization": "int8",
    "kv_cache_dtype": "bfloat16",
}


def _parse(argv: list[str], exclude: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser, exclude=exclude)
    return parser.parse_args(argv)


def _argv(values: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        argv += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return argv


def test_no_flags_give_the_defaults() -> None:
    assert EngineConfig.from_cli_args(_parse([])) == EngineConfig()


def test_every_field_is_set_by_its_flag() -> None:
    assert set(VALUES) == {field.name for field in fields(EngineConfig)}
    defaults = EngineConfig()
    assert all(getattr(defaults, name) != value for name, value in VALUES.items())
    assert EngineConfig.from_cli_args(_parse(_argv(VALUES))) == EngineConfig(**VALUES)


def test_booleans_take_both_forms() -> None:
    for flag, expected in (("--static-padding", True), ("--no-static-padding", False),
                           ("--prepack-weights", True), ("--no-prepack-weights", False),
                           ("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False),
                           ("--enforce-eager", True), ("--no-enforce-eager", False)):
        name = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
        assert getattr(EngineConfig.from_cli_args(_parse([flag])), name) is expected


@pytest.mark.parametrize("argv", [
    ["--max-num-seqs", "0"], ["--max-num-batched-tokens", "-1"], ["--block-size", "0"], ["--num-kv-blocks", "0"],
    ["--max-model-len", "1"], ["--prefill-budget", "-1"], ["--device", "tpu"], ["--priority-aging-steps", "0"],
    ["--request-timeout", "0"], ["--request-timeout", "inf"],
])
def test_bad_values_raise_value_error(argv: list[str]) -> None:
    args = _parse(argv)
    with pytest.raises(ValueError, match=argv[0].removeprefix("--").replace("-", "_")):
        EngineConfig.from_cli_args(args)


@pytest.mark.parametrize("argv", [["--policy", "greedy"], ["--scheduling-policy", "lifo"], ["--dtype", "int4"], ["--quantization", "q2"], ["--kv-cache-dtype", "fp4"],
                                  ["--max-num-seqs", "many"]])
def test_values_outside_the_choices_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(argv)


def test_excluded_fields_keep_defaults_or_the_commands_values() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=7)  # the command's own --seed (a workload's)
    EngineConfig.add_cli_args(parser, exclude=("seed",))
    parser.set_defaults(max_num_seqs=16)  # a command's own default
    args = parser.parse_args(["--seed", "9"])
    assert EngineConfig.from_cli_args(args) == EngineConfig(max_num_seqs=16)  # the engine's seed is not 9
    assert EngineConfig.from_cli_args(args, seed=3).seed == 3
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        EngineConfig.add_cli_args(argparse.ArgumentParser(), exclude=("seeds",))


def test_commands_read_the_engine_flags() -> None:
    parser = _build_parser()
    serve = parser.parse_args(["serve", "--no-static-padding", "--max-num-seqs", "3", "--port", "9"])
    assert EngineConfig.from_cli_args(serve) == EngineConfig(static_padding=False, max_num_seqs=3)
    generate = parser.parse_args(["generate", "hi", "--seed", "4", "--no-prepack-weights", "--policy", "static"])
    assert generate.seed == 4  # the request's sampling seed; the engine's stays the default
    assert EngineConfig.from_cli_args(generate) == EngineConfig(prepack_weights=False, policy="static")
    offline = parser.parse_args(["bench", "offline", "--seed", "2", "--quantization", "fp16"])
    assert offline.policies == "both" and offline.seed == 2  # the workload's seed
    assert EngineConfig.from_cli_args(offline) == EngineConfig(max_num_seqs=16, max_model_len=1024, quantization="fp16")
    compare = parser.parse_args(["bench", "compare", "--batch-size", "4", "--max-model-len", "256"])
    assert compare.batch_size == 4 and EngineConfig.from_cli_args(compare).max_model_len == 256
    roofline = parser.parse_args(["bench", "roofline", "--dtype", "float32", "--block-size", "32"])
    assert EngineConfig.from_cli_args(roofline) == EngineConfig(dtype="float32", block_size=32, max_model_len=1024)
    bench_serve = parser.parse_args(["bench", "serve", "--base-url", "http://x", "--workload", "w", "--model", "m"])
    assert bench_serve.request_model == "m" and not hasattr(bench_serve, "model")
    for command in (["bench", "compare", "--max-num-seqs", "4"], ["bench", "offline", "--static-padding"],
                    ["bench", "roofline", "--prefill-budget", "3"]):  # flags the command sets itself
        with pytest.raises(SystemExit):
            parser.parse_args(command)


def test_invalid_engine_options_are_reported_before_loading(capsys: pytest.CaptureFixture[str],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    assert cli_main(["generate", "hi", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err.startswith("backfill generate: max_num_seqs must be a positive integer")
    with caplog.at_level(logging.ERROR):
        assert launcher_main(["--device", "tpu"]) == 2
    assert "invalid engine option: device must be" in caplog.text
