"""Varied real-text prompts for engine and server tests."""

from __future__ import annotations

import random

TOPICS = [
    "The history of the printing press",
    "How photosynthesis turns light into sugar",
    "Why the sky is blue",
    "A recipe for a simple tomato soup",
    "The rules of chess for beginners",
    "What makes a good password",
    "The life cycle of a star",
    "How vaccines train the immune system",
    "Tips for learning a new language",
    "The water cycle explained to a child",
    "Why cats purr",
    "How a bicycle stays upright",
]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Varied real-text prompts, short to long (the long ones force chunked prefill)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        repeats = rng.choice([0, 0, 1, 3, 8])
        context = " ".join(f"{t}." for t in rng.sample(TOPICS, k=min(len(TOPICS), 2 + repeats)))
        prompts.append(f"{context} Write a short paragraph about: {topic.lower()}.\n")
    return prompts
