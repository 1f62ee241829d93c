"""The `backfill` command: serve | generate | bench | plan."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from backfill.config import EngineConfig


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
    generate.add_argument("--seed", type=int, default=None, help="this request's sampling seed")
    # --seed above is the request's, so the engine's (seeding requests without one) is left out.
    EngineConfig.add_cli_args(generate, exclude=("seed",))

    from backfill.entrypoints.openai.launcher import add_serve_arguments

    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_serve_arguments(serve)

    from backfill.bench.cli import add_bench_subparser

    add_bench_subparser(commands)

    from backfill.bench.plan_cli import add_plan_subparser

    add_plan_subparser(commands)
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
        config = EngineConfig.from_cli_args(args)
    except ValueError as error:
        print(f"backfill generate: {error}", file=sys.stderr)
        return 2
    llm = LLM(**dataclasses.asdict(config))
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
    if args.command == "plan":
        from backfill.bench.plan_cli import run_plan

        return run_plan(args)
    from backfill.bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
