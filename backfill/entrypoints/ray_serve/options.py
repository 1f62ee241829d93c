"""The `backfill serve` options for Ray Serve, and the router's thresholds (no Ray import here)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ROUTER_POLICIES = ("cache-aware", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    """The cache-aware router's thresholds (SGLang's cache_aware policy).

    Load imbalanced: max load - min load > `balance_abs_threshold` AND max load >
    `balance_rel_threshold` x min load, where a replica's load is its running + waiting
    sequences. Imbalanced: the least loaded replica. Balanced: the replica whose cached prefix
    covers the largest share of the prompt, if that share is at least `cache_threshold`;
    otherwise the replica holding the least cached text (it has the most room).
    """

    policy: str = "cache-aware"
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--router: one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--router-balance-abs-threshold: must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"--router-balance-rel-threshold: must be >= 1, got {self.balance_rel_threshold}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--router-cache-threshold: must be in [0, 1], got {self.cache_threshold}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RouterConfig:
        return cls(args.router, args.router_balance_abs_threshold, args.router_balance_rel_threshold,
                   args.router_cache_threshold)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RouterConfig()
    group = parser.add_argument_group("Ray Serve (several engines behind one endpoint)")
    group.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas on Ray Serve (each its own process, --num-threads each)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. HEAD:6379) instead of starting a local Ray instance")
    group.add_argument("--router", choices=ROUTER_POLICIES, default=defaults.policy,
                       help="how requests pick a replica (round-robin: for comparison)")
    group.add_argument("--router-balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
                       help="load is imbalanced when max - min load exceeds this (and the relative threshold)")
    group.add_argument("--router-balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                       help="... and max load exceeds this times the min load; then the least loaded replica")
    group.add_argument("--router-cache-threshold", type=float, default=defaults.cache_threshold,
                       help="share of the prompt a replica's cached prefix must cover to be preferred")
