"""Constrained decoding: grammars compiled by llguidance, applied as a token mask per step."""

from backfill.structured_output.compiler import GrammarCompiler, grammar_text

__all__ = ["GrammarCompiler", "grammar_text"]
