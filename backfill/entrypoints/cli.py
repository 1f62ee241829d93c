"""The `backfill` command: serve | generate | bench."""

from __future__ import annotations

import argparse
import logging
import sys

from backfill.config import DTYPES, POLICIES, QUANTIZATIONS


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--policy", choices=POLICIES, default="continuous")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="weight storage: auto (a GGUF as stored), none (expanded to --dtype), int8, fp16")
    parser.add_argument("--device", default="cpu")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backfill", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt and print the text")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int, default=None)
    _add_engine_arguments(generate)

    from backfill.entrypoints.openai.launcher import add_serve_arguments

    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_serve_arguments(serve)

    from backfill.bench.cli import add_bench_subparser

    add_bench_subparser(commands)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from backfill.engine.llm import LLM
    from backfill.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValueError as error:
        print(f"backfill generate: {error}", file=sys.stderr)
        return 2
    llm = LLM(model=args.model, policy=args.policy, dtype=args.dtype, quantization=args.quantization,
              device=args.device)
    try:
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            output = llm.generate([args.prompt], params)[0]
    except ValueError as error:
        print(f"backfill generate: {error}", file=sys.stderr)
        return 2
    print(output.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from backfill.entrypoints.openai.launcher import run_server

        return run_server(args)
    from backfill.bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
