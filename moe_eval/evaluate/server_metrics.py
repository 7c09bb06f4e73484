"""What vLLM's own /metrics says about the requests it served (vLLM 0.26 and 0.32 alike).

Read around a group of requests, the difference of two readings is what the server did for that group:
- `vllm:prefix_cache_hits`: prompt tokens served from the prefix cache (the sweep keeps it 0);
- `vllm:inter_token_latency_seconds`: the engine's time between a sequence's consecutive tokens, one
  observation per generated token after the first: the decode step as the engine ran it;
- `vllm:request_prefill_time_seconds`: a finished request's time from being scheduled to its first token.
The last two are the engine's clock (vLLM stamps each engine-core output), so they hold no HTTP, no
tokenizing, no queueing: the client's wall time around a 12-token request holds all of those and the
request's prefill, and it moved x1.7 between runs of one vLLM row on the H100s (docs/perf.md). vLLM records
an iteration's stats in the output loop right after handing its outputs to the requests, before the event
loop can send a reply, so a reading taken after the replies holds every observation of the group.
"""

from __future__ import annotations

import re

import requests

PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # a histogram: its _sum and _count are read
PREFILL_TIME = "vllm:request_prefill_time_seconds"

_SAMPLE = re.compile(r"(?P<name>vllm:\w+)(?:\{[^}]*\})?\s+(?P<value>\S+)(?:\s+\d+)?")  # an optional timestamp
_READ = (
    PREFIX_CACHE_HITS,
    *(f"{h}_{part}" for h in (INTER_TOKEN_LATENCY, PREFILL_TIME) for part in ("sum", "count")),
)

Totals = dict[str, float]


def totals_in(metrics_text: str) -> Totals:
    """Each sample this module reads, summed over its label sets (one per engine); a sample whose value does
    not parse leaves its name out, as does a server that does not export it (stats off)."""
    totals: Totals = {}
    unreadable = set()
    for line in metrics_text.splitlines():
        match = _SAMPLE.fullmatch(line.strip())
        if match is None or match["name"] not in _READ:
            continue
        try:
            totals[match["name"]] = totals.get(match["name"], 0.0) + float(match["value"])
        except ValueError:
            unreadable.add(match["name"])
    return {name: value for name, value in totals.items() if name not in unreadable}


def read_totals(base_url: str, timeout: float) -> Totals | None:
    """The server's totals now; None where /metrics does not answer."""
    try:
        reply = requests.get(f"{base_url}/metrics", timeout=timeout)
        reply.raise_for_status()
    except requests.RequestException:
        return None
    return totals_in(reply.text)


def prefix_cache_hits(totals: Totals | None) -> int | None:
    """The prompt tokens served from the prefix cache over the engines; None where the counter is not there, a
    sample does not parse, or /metrics did not answer."""
    hits = (totals or {}).get(PREFIX_CACHE_HITS)
    return None if hits is None else round(hits)


def mean_between(before: Totals | None, after: Totals | None, histogram: str) -> float | None:
    """The mean of the observations a histogram gained between two readings; None where a reading lacks it or
    it gained none."""
    if before is None or after is None:
        return None
    try:
        added = after[f"{histogram}_count"] - before[f"{histogram}_count"]
        seconds = after[f"{histogram}_sum"] - before[f"{histogram}_sum"]
    except KeyError:
        return None
    return seconds / added if added > 0 else None
