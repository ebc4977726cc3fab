"""The pure parts of ``kvcodec soak --chaos``: the fault schedule, the prompt mix, and the verdict.

Fault kinds (``KINDS``), each with the *target* it acts on (faults on one target never overlap;
faults on different targets do, at random) and how long it is held (``HOLD_S``: seconds, drawn
uniformly):

- ``store-kill``: the store's process(es) SIGKILLed, restarted after the hold (target ``store``);
- ``store-pause``: SIGSTOP, SIGCONT after the hold (``store``);
- ``trickle`` / ``stall``: the proxy between the servers and the store trickles one byte every
  50 ms, or stalls after 200 kB, for the hold (``link``; ``kvcodec_tools.fault_proxy``);
- ``failover``: a Redis Cluster master SIGKILLed, its replica promoted, the old master back as a
  replica after the hold (``store``; redis-cluster only);
- ``disk-full``: the file system under the nginx store filled, emptied after the hold (``disk``;
  nginx only, as root: a tmpfs is mounted there);
- ``stub-kill``: a python backend stub of one server SIGKILLed mid-request; the server's watchdog
  restarts it (``servers``: one server down at a time, the balancer sends the rest to the others);
- ``decoder-kill``: kv_decode's decoder process of one server SIGKILLed mid-chunk (``decoder``).

``schedule`` draws the faults; ``verdict`` and friends read the outcomes against the references.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

TARGET = {"store-kill": "store", "store-pause": "store", "trickle": "link", "stall": "link", "failover": "store",
          "disk-full": "disk", "stub-kill": "servers", "decoder-kill": "decoder"}
KINDS = tuple(TARGET)
HOLD_S = {"store-kill": (4.0, 15.0), "store-pause": (3.0, 12.0), "trickle": (4.0, 15.0), "stall": (4.0, 15.0),
          "failover": (5.0, 15.0), "disk-full": (8.0, 25.0), "stub-kill": (0.0, 0.0), "decoder-kill": (0.0, 0.0)}
# seconds a target rests after a fault before the next one on it (a server's restart is measured:
# the next fault on "servers" waits for it at run time too; the watchdog's storm guard allows 5
# restarts in 300 s, so stub kills are spaced)
SETTLE_S = {"store": 5.0, "link": 3.0, "disk": 5.0, "servers": 75.0, "decoder": 5.0}
STORE_KINDS = {
    "nginx": ("store-kill", "store-pause", "trickle", "stall", "disk-full", "stub-kill", "decoder-kill"),
    "redis": ("store-kill", "store-pause", "trickle", "stall", "stub-kill", "decoder-kill"),
    "redis-cluster": ("failover", "store-pause", "stub-kill", "decoder-kill"),
    "s3": ("store-kill", "store-pause", "trickle", "stall", "stub-kill", "decoder-kill"),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float  # planned start, seconds from the start of the load
    hold_s: float

    @property
    def target(self) -> str:
        return TARGET[self.kind]


def schedule(kinds: Sequence[str], duration_s: float, seed: int, mean_gap_s: float, start_s: float = 15.0,
             end_margin_s: float = 20.0) -> List[Fault]:
    """Faults from ``start_s`` to ``duration_s - end_margin_s`` (the last heal leaves the load time to
    show reuse back), gaps exponential with mean ``mean_gap_s``, kinds in shuffled rounds (every
    kind once before any twice); a fault whose target is still busy (its previous fault held, then
    ``SETTLE_S``) moves to when the target is free, and is dropped past the end. Faults on
    different targets overlap freely."""
    unknown = [k for k in kinds if k not in TARGET]
    if unknown or not kinds:
        raise ValueError(f"unknown fault kind(s) {unknown} (known: {', '.join(KINDS)})" if unknown else "no fault kinds")
    if mean_gap_s <= 0:
        raise ValueError("mean_gap_s must be > 0")
    rng = random.Random(seed)
    end = duration_s - end_margin_s
    free_at: Dict[str, float] = {}
    out: List[Fault] = []
    t = start_s
    deck: List[str] = []
    while t < end:
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        lo, hi = HOLD_S[kind]
        hold = round(rng.uniform(lo, hi), 1)
        at = max(t, free_at.get(TARGET[kind], 0.0))
        if at + hold < end:
            out.append(Fault(kind, round(at, 1), hold))
            free_at[TARGET[kind]] = at + hold + SETTLE_S[TARGET[kind]]
        t += rng.expovariate(1.0 / mean_gap_s)
    return sorted(out, key=lambda f: f.at_s)


# -- the prompt mix ------------------------------------------------------------------------------
# kind -> (reuse on, the codecs input): ``reuse`` reads a fully stored context through the server's
# ladder; ``decoded`` a context stored only at the rung that kv_decode's decoder process decodes;
# ``partial`` shares the first chunks of a stored context; ``writeback`` is a long prompt whose
# chunks the driver deletes before each ask (so it misses and writes back every time); ``miss`` is
# shorter than a chunk (nothing to fetch or store); ``prefill`` is reuse off: the control.
PROMPT_KINDS = ("reuse", "decoded", "partial", "writeback", "miss", "prefill")
DECODED_RUNG = "lossless8"


def mix(prompts: Dict[str, Sequence[int]]) -> List[Tuple[str, int]]:
    """(kind, index) of every request in a client's cycle: each prompt of each kind once, the
    kinds interleaved; ``prompts`` is {kind: number of prompts of that kind}, ``reuse`` and
    ``prefill`` twice as often as the rest (the reuse path and the bound's control)."""
    cycle: List[Tuple[str, int]] = []
    longest = max(prompts.values(), default=0)
    for i in range(longest):
        for kind in PROMPT_KINDS:
            n = prompts.get(kind, 0)
            if n:
                cycle.append((kind, i % n))
                if kind in ("reuse", "prefill"):
                    cycle.append((kind, (i + 1) % n))
    return cycle


# -- reading the outcomes ------------------------------------------------------------------------
@dataclass
class Answer:
    client: int
    kind: str  # one of PROMPT_KINDS
    prompt: str  # the prompt's name, e.g. "reuse0"
    start_s: float
    end_s: float
    ttft_s: Optional[float] = None  # client side, first attempt's start to the first token of the answer
    reused_tokens: int = 0
    tokens: Optional[List[int]] = None
    attempts: int = 1  # 1 + the server failures the client asked again after
    error: str = ""  # the request was lost: no answer after every attempt
    miss_reason: str = ""
    verdict: str = ""  # "ok", "wrong", "lost" or "unchecked" (see ``check``)


def expected(references: Dict[Tuple[str, int], List[int]], prompt: str, reused_tokens: int) -> Optional[List[int]]:
    """The answer a request must give: the reference of the same prompt with the same number of
    reused tokens (``references[prompt, reused]``; lossless rungs and prefill give prefill's answer
    at any reuse, so those prompts are keyed at 0 only); None when no reference has that reuse."""
    if (prompt, reused_tokens) in references:
        return references[prompt, reused_tokens]
    if (prompt, -1) in references:  # any reuse: the prompt's answers are all prefill's
        return references[prompt, -1]
    return None


def check(answer: Answer, references: Dict[Tuple[str, int], List[int]]) -> str:
    """The answer's verdict: ``lost`` (no answer); ``ok`` when it is the prompt's prefill answer
    (``references[prompt, 0]``, where the prompt has one); else ``ok`` / ``wrong`` against
    ``expected``, or ``unchecked`` (a reuse the references do not cover: counted, never taken as right)."""
    if answer.error or answer.tokens is None:
        return "lost"
    if answer.tokens == references.get((answer.prompt, 0)):
        return "ok"  # the model's own prefill: right at any reuse (a lossless copy gives it)
    want = expected(references, answer.prompt, answer.reused_tokens)
    if want is None:
        return "unchecked"
    return "ok" if answer.tokens == want else "wrong"


# Requests held to no TTFT bound: the control itself.
UNBOUNDED = ("prefill",)


def ttft_bounds(answers: Sequence[Answer], alone_prefill_s: Dict[str, float], window_s: float = 60.0,
                floor_s: float = 2.0) -> Dict[int, float]:
    """{index in ``answers``: the TTFT bound} of every answered request not in ``UNBOUNDED``: the
    median TTFT of the ``prefill`` requests (reuse off, under the same load) that started within
    ``window_s`` of it (all of them when none did), plus max(``floor_s``, the prompt's prefill alone)."""
    controls = [(a.start_s, a.ttft_s) for a in answers if a.kind == "prefill" and a.ttft_s is not None]
    if not controls:
        return {}
    overall = statistics.median(t for _, t in controls)
    out = {}
    for i, a in enumerate(answers):
        if a.kind in UNBOUNDED or a.ttft_s is None:
            continue
        near = [t for s, t in controls if abs(s - a.start_s) <= window_s]
        base = statistics.median(near) if near else overall
        out[i] = base + max(floor_s, alone_prefill_s.get(a.prompt, 0.0))
    return out


def reuse_back(answers: Sequence[Answer], healed_s: Optional[float], full_tokens: Dict[str, int]) -> Optional[float]:
    """Seconds from ``healed_s`` to the end of the first ``reuse`` request that started after it and
    reused its whole stored prefix; None if none did (or the fault never healed)."""
    if healed_s is None:
        return None
    ends = [a.end_s for a in answers if a.kind == "reuse" and a.start_s >= healed_s and not a.error
            and a.reused_tokens >= full_tokens.get(a.prompt, 1)]
    return round(min(ends) - healed_s, 2) if ends else None


def reuse_not_back(answers: Sequence[Answer], faults: Sequence[dict]) -> Tuple[int, int]:
    """(healed faults after which a ``reuse`` request started but whole reuse never came back, healed
    faults after which no ``reuse`` request started at all: healed as the load ended, not observed)."""
    not_back = unobserved = 0
    for f in faults:
        if f["healed_s"] is None or f["reuse_back_s"] is not None:
            continue
        if any(a.kind == "reuse" and a.start_s >= f["healed_s"] for a in answers):
            not_back += 1
        else:
            unobserved += 1
    return not_back, unobserved
