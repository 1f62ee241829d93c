"""The ingress's /metrics text: the replicas' Prometheus texts merged with a `replica` label, and
the router's decisions. No Ray here."""

from __future__ import annotations

from collections.abc import Mapping

ROUTER_REQUESTS = "backfill:router_requests_total"
STREAM_ITEMS = "backfill:ray_stream_items_total"


def _with_label(sample: str, label: str) -> str:
    """`name{a="b"} 1.0` -> `name{replica="r",a="b"} 1.0`; `name 1.0` -> `name{replica="r"} 1.0`."""
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and brace < space:
        return f'{sample[:brace]}{{replica="{label}",{sample[brace + 1:]}'.replace(",}", "}")
    return f'{sample[:space]}{{replica="{label}"}}{sample[space:]}'


def merge_metrics(texts: Mapping[str, str]) -> str:
    """One exposition text from each replica's (by replica label): each family's HELP/TYPE once,
    then every replica's samples of it."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for label, text in sorted(texts.items()):
        current = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP "):
                current = line.split(" ", 3)[2]
                families.setdefault(current, ([], []))
                if not families[current][0]:
                    families[current][0].append(line)
            elif line.startswith("# TYPE "):
                headers = families.setdefault(current, ([], []))[0]
                if len(headers) < 2:
                    headers.append(line)
            elif not line.startswith("#"):
                families.setdefault(current, ([], []))[1].append(_with_label(line, label))
    lines = [line for headers, samples in families.values() for line in (*headers, *samples)]
    return "\n".join(lines) + "\n" if lines else ""


def router_metrics(decisions: Mapping[tuple[str, str], int]) -> str:
    """backfill:router_requests_total{reason,replica} from (reason, replica) -> count."""
    lines = [f"# HELP {ROUTER_REQUESTS} Requests the router sent to a replica, by the reason for the choice.",
             f"# TYPE {ROUTER_REQUESTS} counter"]
    lines += [f'{ROUTER_REQUESTS}{{reason="{reason}",replica="{replica}"}} {float(count)}'
              for (reason, replica), count in sorted(decisions.items())]
    return "\n".join(lines) + "\n"


def stream_item_metrics(num_items: Mapping[str, int]) -> str:
    """backfill:ray_stream_items_total{kind} from kind ("mux", "inline") -> Ray items received."""
    lines = [f"# HELP {STREAM_ITEMS} Stream items the ingress received: mux batches (ZMQ), or a request's own (Ray).",
             f"# TYPE {STREAM_ITEMS} counter"]
    lines += [f'{STREAM_ITEMS}{{kind="{kind}"}} {float(count)}' for kind, count in sorted(num_items.items())]
    return "\n".join(lines) + "\n"
