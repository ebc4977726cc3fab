"""Peers' workloads, their prompts and their figures: LMCache's long-document QA
(``benchmarks/long_doc_qa/long_doc_qa.py``) and multi-round QA (``benchmarks/multi_round_qa/
multi-round-qa.py``), with the same knobs and metric definitions. This module only builds prompts,
schedules and rows (no server, no network); ``workload_run`` sends them, ``workload_cli`` is the
command (``kvcodec bench workload long-doc-qa|multi-round``).

long-doc-qa (LMCache's): ``documents`` documents of ``document_tokens`` tokens; a warm-up round
sends each document once; the query round sends them ``repeat_count`` times, ordered by
``repeat_mode`` (``random``: shuffled with ``shuffle_seed``; ``tile``: [1,2,3,1,2,3];
``interleave``: [1,1,2,2,3,3]), and with ``hit_miss`` "H:M" every request i with i % (H+M) >= H
made a miss by a random number put before it (LMCache's ``add_cache_misses``); at most
``inflight`` requests at a time. Figures: mean TTFT per round, round time (first send to last
answer), TTFT gain = warm-up mean TTFT / query mean TTFT. Differences from LMCache: the documents
are real text (standard-library modules, each headed by its number so none is a prefix of
another) with a question after them, where LMCache repeats "hi"; TTFT is the first non-empty text
(LMCache's completions mode waits for non-whitespace); prompts go to ``/v1/completions``.

multi-round (LMCache's): ``users`` users, each ``rounds`` turns; every user's first prompt is the
shared system prompt (``system_tokens``) and its own context (``user_info_tokens``), then its
question; each later turn sends the whole conversation so far (questions and the model's
answers) and a new question; ``answer_tokens`` per answer. Arrivals as LMCache's
``UserSessionManager``: with ``qps`` the overall request rate, a user sends a turn every
``users / qps`` seconds (not before its previous answer came back) and a new user joins every
``(users / qps) * (rounds - 1) / users`` seconds. Figures: turn 1 is the warm-up (nothing of its
own conversation is cached yet, the system prompt may be), later turns the query; TTFT per turn.

Rows (``--json``): ``workload``, ``method``, ``bandwidth_mbps``, ``restart_between_rounds``,
``warmup_ttft_mean_s``, ``query_ttft_mean_s``, ``ttft_gain``, ``warmup_round_s``,
``query_round_s``, ``answers_equal`` (every answer equal to prefill's, greedy), ``mismatches``,
``requests`` (one entry per request: round or turn, times, cached tokens, equal), ``ttft_by_turn``
(multi-round), ``config``. A file holds one row per (workload, method, bandwidth_mbps,
restart_between_rounds): a new run replaces its own row and keeps the others.
"""
from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .texts import cut_to_tokens, stdlib_text

REPEAT_MODES = ("random", "tile", "interleave")
DOC_SOURCES = ("argparse.py", "typing.py", "inspect.py", "pathlib.py", "ast.py", "enum.py", "subprocess.py",
               "tarfile.py", "logging/__init__.py", "collections/__init__.py", "dataclasses.py", "functools.py")
SYSTEM_SOURCE = "textwrap.py"
USER_SOURCES = ("shlex.py", "fnmatch.py", "glob.py", "string.py", "heapq.py", "bisect.py")
QUESTION = "\n\n# Question: what does the code above do?\n# Answer:"
MAX_REQUESTS = 10_000  # a bound on one run's requests


@dataclass(frozen=True)
class LongDocConfig:
    documents: int = 8
    document_tokens: int = 20000
    output_tokens: int = 100
    repeat_count: int = 2
    repeat_mode: str = "random"
    shuffle_seed: int = 0
    hit_miss: Optional[str] = None
    inflight: int = 2

    def __post_init__(self) -> None:
        for name in ("documents", "document_tokens", "output_tokens", "repeat_count", "inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.repeat_mode not in REPEAT_MODES:
            raise ValueError(f"repeat_mode must be one of {', '.join(REPEAT_MODES)}, got {self.repeat_mode!r}")
        parse_hit_miss(self.hit_miss)
        if self.documents * (self.repeat_count + 1) > MAX_REQUESTS:
            raise ValueError(f"documents x (repeat_count + 1) is over {MAX_REQUESTS} requests")


@dataclass(frozen=True)
class MultiRoundConfig:
    users: int = 10
    rounds: int = 5
    system_tokens: int = 1000
    user_info_tokens: int = 0
    answer_tokens: int = 100
    qps: float = 0.5

    def __post_init__(self) -> None:
        for name in ("users", "rounds", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens < 0 or self.user_info_tokens < 0:
            raise ValueError("system_tokens and user_info_tokens must be >= 0")
        if not self.qps > 0:
            raise ValueError(f"qps must be > 0, got {self.qps}")
        if self.users * self.rounds > MAX_REQUESTS:
            raise ValueError(f"users x rounds is over {MAX_REQUESTS} requests")


# ---- long-doc-qa ---------------------------------------------------------------------------------

def _long_text(tokenizer, sources: Sequence[str], start: int, tokens: int) -> str:
    """At least ``tokens`` tokens of whole lines from ``sources``, beginning with ``sources[start]``
    and going on to the next ones while short."""
    text = ""
    for k in range(len(sources)):
        text += stdlib_text(sources[(start + k) % len(sources)])
        if len(tokenizer.encode(text)) >= tokens:
            break
    return cut_to_tokens(tokenizer, text, tokens)


def documents(tokenizer, n: int, tokens: int) -> List[str]:
    """``n`` prompts of about ``tokens`` tokens: document i is headed by its number (none is a prefix
    of another, as LMCache's), a standard-library text after it, a question at its end."""
    return [f"Document {i}.\n" + _long_text(tokenizer, DOC_SOURCES, i, tokens) + QUESTION for i in range(n)]


def repeat_prompts(items: Sequence, count: int, mode: str, rng: random.Random) -> List:
    """LMCache's ``repeat_prompts``: ``random`` (all repeats, shuffled), ``tile``, ``interleave``."""
    if mode == "random":
        out = list(items) * count
        rng.shuffle(out)
        return out
    if mode == "tile":
        return list(items) * count
    if mode == "interleave":
        return [x for x in items for _ in range(count)]
    raise ValueError(f"repeat_mode must be one of {', '.join(REPEAT_MODES)}, got {mode!r}")


def parse_hit_miss(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """"H:M" -> (H, M); None for None."""
    if text is None:
        return None
    try:
        hit, miss = (int(x) for x in text.split(":", 1))
    except ValueError:
        raise ValueError(f"hit_miss is H:M with H and M whole numbers, got {text!r}") from None
    if hit < 0 or miss < 0 or hit + miss == 0:
        raise ValueError(f"hit_miss needs H, M >= 0 and H + M > 0, got {text!r}")
    return hit, miss


def miss_positions(n: int, hit_miss: Optional[str]) -> List[bool]:
    """For each of ``n`` query requests, whether it is made a miss: i % (H+M) >= H (LMCache's)."""
    parsed = parse_hit_miss(hit_miss)
    if parsed is None:
        return [False] * n
    hit, miss = parsed
    return [i % (hit + miss) >= hit for i in range(n)]


@dataclass(frozen=True)
class Query:
    """One request of a round: the document it asks about, whether it was made a miss, its prompt."""
    doc: int
    miss: bool
    prompt: str


def query_round(prompts: Sequence[str], config: LongDocConfig) -> List[Query]:
    """The query round: the documents repeated as ``repeat_mode`` says, then the misses mixed in (a
    random number and a space before the prompt, as LMCache's ``add_cache_misses``)."""
    rng = random.Random(config.shuffle_seed)
    order = repeat_prompts(range(len(prompts)), config.repeat_count, config.repeat_mode, rng)
    out = []
    for doc, miss in zip(order, miss_positions(len(order), config.hit_miss), strict=True):
        prompt = f"{rng.randint(-10_000_000, 10_000_000)} {prompts[doc]}" if miss else prompts[doc]
        out.append(Query(doc, miss, prompt))
    return out


# ---- multi-round ---------------------------------------------------------------------------------

def user_question(turn: int) -> str:
    """LMCache's question for turn ``turn`` (1-based)."""
    return f"Here's question #{turn}: can you tell me a new long story with a happy ending?"


def system_prompt(tokenizer, tokens: int) -> str:
    """The system prompt every user shares."""
    if tokens == 0:
        return "System: you are a helpful assistant.\n"
    return "System: here is some system prompt:\n" + _long_text(tokenizer, (SYSTEM_SOURCE,) + DOC_SOURCES, 0,
                                                                  tokens) + "\n"


def user_context(tokenizer, user: int, tokens: int) -> str:
    """User ``user``'s own context (LMCache's "user info"), after the shared system prompt."""
    head = f"For user {user}, here is some other context:\n"
    if tokens == 0:
        return head
    return head + _long_text(tokenizer, USER_SOURCES, user, tokens) + "\n"


def conversation_prompt(system: str, context: str, answers: Sequence[str]) -> str:
    """The prompt of turn ``len(answers) + 1``: system prompt, user context, each earlier question
    with the model's answer, the new question; the previous turn's prompt is a prefix of it."""
    text = system + context
    for turn, answer in enumerate(answers, start=1):
        text += f"\nUser: {user_question(turn)}\nAssistant:{answer}"
    return text + f"\nUser: {user_question(len(answers) + 1)}\nAssistant:"


def user_gaps(config: MultiRoundConfig) -> Tuple[float, float]:
    """(seconds between a user's turns, seconds between users joining), as LMCache's
    ``UserSessionManager``: users / qps, and that times (rounds - 1) / users."""
    per_user = config.users / config.qps
    return per_user, per_user * (config.rounds - 1) / config.users


def arrival_schedule(config: MultiRoundConfig, first_turn: int = 1,
                     last_turn: Optional[int] = None) -> List[Tuple[float, int, int]]:
    """(earliest send time in seconds from the start, user, turn) for turns ``first_turn`` ..
    ``last_turn`` (1-based, inclusive), sorted by time: user u joins at u x the joining gap and
    sends turn k (k - first_turn) turn gaps later (and not before its previous answer is back,
    which the runner waits for)."""
    last_turn = config.rounds if last_turn is None else last_turn
    if not 1 <= first_turn <= last_turn <= config.rounds:
        raise ValueError(f"turns {first_turn}..{last_turn} are outside 1..{config.rounds}")
    per_user, joining = user_gaps(config)
    out = [(u * joining + (k - first_turn) * per_user, u, k) for u in range(config.users)
           for k in range(first_turn, last_turn + 1)]
    return sorted(out)


# ---- figures and rows ----------------------------------------------------------------------------

@dataclass
class Record:
    """One request: ``round`` ("warmup" / "query"), ``doc`` or ``user``/``turn``, times from the start
    of its round (``start_s``, ``ttft_s`` from its own send, ``end_s``), ``cached_tokens`` (what the
    server says it reused), ``equal`` (its answer equal to prefill's)."""
    round: str
    start_s: float
    ttft_s: float
    end_s: float
    cached_tokens: Optional[int] = None
    equal: Optional[bool] = None
    doc: Optional[int] = None
    miss: Optional[bool] = None
    user: Optional[int] = None
    turn: Optional[int] = None
    text: str = ""
    prompt: str = ""

    def public(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None and k not in ("text", "prompt")}
        for k in ("start_s", "ttft_s", "end_s"):
            out[k] = round(out[k], 4)
        return out


def mean(values: Sequence[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def ttft_gain(warmup: Optional[float], query: Optional[float]) -> Optional[float]:
    """LMCache's TTFT gain: warm-up mean TTFT / query mean TTFT (None when either is missing or 0)."""
    if not warmup or not query:
        return None
    return warmup / query


def round_span(records: Sequence[Record]) -> Optional[float]:
    """A round's time: its first send to its last answer."""
    if not records:
        return None
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def make_row(workload: str, method: str, bandwidth_mbps: Optional[float], restart: bool, records: Sequence[Record],
             config: dict, warmup_round_s: Optional[float] = None,
             query_round_s: Optional[float] = None, routing: str = "none", tiers: Optional[dict] = None) -> dict:
    """The row of one run. Round times default to the span of each round's records. ``routing``: the
    router's policy in front of several replicas (``prefix``, ``round-robin``; ``none``: one server);
    ``tiers``: chunks the replicas' connectors reused by tier (``local``, ``remote``), and from it
    ``local_hit_rate`` (local / both)."""
    warm = [r for r in records if r.round == "warmup"]
    query = [r for r in records if r.round == "query"]
    w, q = mean([r.ttft_s for r in warm]), mean([r.ttft_s for r in query])
    checked = [r for r in records if r.equal is not None]
    row = {"workload": workload, "method": method, "bandwidth_mbps": bandwidth_mbps,
           "restart_between_rounds": bool(restart), "routing": routing, "warmup_ttft_mean_s": _r(w), "query_ttft_mean_s": _r(q),
           "ttft_gain": _r(ttft_gain(w, q)),
           "warmup_round_s": _r(round_span(warm) if warmup_round_s is None else warmup_round_s),
           "query_round_s": _r(round_span(query) if query_round_s is None else query_round_s),
           "answers_equal": bool(checked) and len(checked) == len(records) and all(r.equal for r in checked),
           "mismatches": sum(1 for r in checked if not r.equal), "config": config,
           "requests": [r.public() for r in records]}
    if tiers is not None:
        both = sum(tiers.values())
        row["tier_chunks"] = dict(tiers)
        row["local_hit_rate"] = _r(tiers.get("local", 0) / both) if both else None
    turns = sorted({r.turn for r in records if r.turn is not None})
    if turns:
        row["ttft_by_turn"] = {str(k): _r(mean([r.ttft_s for r in records if r.turn == k])) for k in turns}
    return row


def row_key(row: dict) -> tuple:
    return (row["workload"], row["method"], row.get("bandwidth_mbps"), bool(row.get("restart_between_rounds")),
            row.get("routing", "none"))


def merge_rows(path: Path, new: Sequence[dict]) -> List[dict]:
    """Write ``new`` into the JSON file at ``path`` (``{"rows": [...]}``), replacing a row of the same
    (workload, method, bandwidth_mbps, restart_between_rounds, routing) in its place and keeping the others;
    the file's rows afterwards."""
    path = Path(path)
    rows: List[dict] = []
    if path.is_file():
        try:
            rows = list(json.loads(path.read_text()).get("rows", []))
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{path} is not a rows file ({{\"rows\": [...]}}): {exc}") from None
    for row in new:
        keys = [row_key(r) for r in rows]
        if row_key(row) in keys:
            rows[keys.index(row_key(row))] = row
        else:
            rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"targets": targets(rows), "rows": rows}, indent=2) + "\n")
    return rows


KVCODEC_METHODS = ("kvcodec-vllm-serve", "kvcodec-ensemble")


def targets(rows: Sequence[dict]) -> Dict[str, dict]:
    """Issue 43's targets, measured from the rows (never asserted): each ``{"value", "target", "met"}``
    (``met`` None while a row it needs is missing). After a restart between the rounds, long-doc-qa:
    KVCodec's query-round TTFT over LMCache lossless's and fp8's at 100 Mbit/s, over the better of
    them at 10 Gbit/s; multi-round: KVCodec's last turn's TTFT over turn 2's, in its worst row on a link (flat:
    no growth with the conversation); routing: local-tier hit rate, prefix-aware over round-robin."""
    def query(method: str, rate: float, workload: str = "long-doc-qa") -> Optional[float]:
        for r in rows:
            if (r["workload"], r["method"], r.get("bandwidth_mbps"), bool(r.get("restart_between_rounds")),
                    r.get("routing", "none")) == (workload, method, rate, True, "none"):
                return r.get("query_ttft_mean_s")
        return None

    def kvcodec(rate: float) -> Optional[float]:
        found = [q for q in (query(m, rate) for m in KVCODEC_METHODS) if q]
        return min(found) if found else None

    def one(value: Optional[float], limit: float, below: bool = True) -> dict:
        return {"value": _r(value), "target": f"{'<=' if below else '>'} {limit:g}",
                "met": None if value is None else (value <= limit if below else value > limit)}

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a and b else None

    out = {"long_doc_qa_vs_lmcache_100m": one(ratio(kvcodec(100.0), query("lmcache", 100.0)), 0.7),
           "long_doc_qa_vs_lmcache_fp8_100m": one(ratio(kvcodec(100.0), query("lmcache-fp8", 100.0)), 0.9)}
    best = [q for q in (query("lmcache", 10000.0), query("lmcache-fp8", 10000.0)) if q]
    out["long_doc_qa_vs_best_lmcache_10g"] = one(ratio(kvcodec(10000.0), min(best) if best else None), 1.1)
    chats = [r for r in rows if r["workload"] == "multi-round" and r["method"] in KVCODEC_METHODS
             and r.get("restart_between_rounds") and r.get("bandwidth_mbps") and r.get("routing", "none") == "none"
             and len(r.get("ttft_by_turn", {})) >= 3]  # the side-by-side rows, on a link
    growths = [g for g in (ratio(t[max(t, key=int)], t.get("2")) for t in (c["ttft_by_turn"] for c in chats))
               if g is not None]
    growth = max(growths) if growths else None  # the worst KVCodec row: flat must hold for each
    out["multi_round_last_turn_over_turn_2"] = one(growth, 1.2)
    hits = {r.get("routing"): r.get("local_hit_rate") for r in rows if r.get("local_hit_rate") is not None}
    out["routing_prefix_over_round_robin_local_hits"] = one(ratio(hits.get("prefix"), hits.get("round-robin")), 1.0,
                                                            below=False)
    return out


def _method(row: dict) -> str:
    routed = f" ({row['routing']} routing)" if row.get("routing", "none") not in (None, "none") else ""
    return row["method"] + routed


def _rate(row: dict) -> str:
    rate = row.get("bandwidth_mbps")
    return "no link" if rate is None else (f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")


def _panels(rows: Sequence[dict]) -> List[Tuple[str, bool, List[dict]]]:
    """(workload, restart, its rows) for each pair that has rows: one panel each."""
    out = []
    for workload in ("long-doc-qa", "multi-round"):
        for restart in (True, False):
            chosen = [r for r in rows if r["workload"] == workload and bool(r.get("restart_between_rounds")) == restart]
            if chosen:
                out.append((workload, restart, chosen))
    return out


HATCHES = ("", "//", "..", "xx")  # one per link rate in a long-doc-qa panel


def _query_bars(ax, chosen: Sequence[dict], rates: Sequence[str], colour: Dict[str, str]) -> None:
    """Long-doc-qa: the query round's mean TTFT per method, a bar per link rate, its TTFT gain on top."""
    import matplotlib.patches

    names = list(dict.fromkeys(_method(r) for r in chosen))
    here = [rate for rate in rates if any(_rate(r) == rate for r in chosen)]
    width = 0.8 / len(here)
    for j, rate in enumerate(here):
        for r in (r for r in chosen if _rate(r) == rate):
            x, y = names.index(_method(r)) - 0.4 + width * (j + 0.5), r["query_ttft_mean_s"] or 0
            ax.bar([x], [y], width, color=colour[_method(r)], hatch=HATCHES[j % 4], edgecolor="black", linewidth=0.4)
            if r.get("ttft_gain"):
                ax.annotate(f"{r['ttft_gain']:.1f}x", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.legend(handles=[matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch=HATCHES[j % 4], label=rate)
                       for j, rate in enumerate(here)], fontsize=8, title="link", title_fontsize=8)
    ax.set_ylabel("query round: mean TTFT (s)")


def _turn_lines(ax, chosen: Sequence[dict], colour: Dict[str, str], styles: Dict[str, str]) -> None:
    """Multi-round: mean TTFT per turn, a colour per method, a line style per link rate."""
    import matplotlib.ticker

    for r in chosen:
        turns = sorted(r.get("ttft_by_turn", {}), key=int)
        ax.plot([int(k) for k in turns], [r["ttft_by_turn"][k] for k in turns], marker="o",
                color=colour[_method(r)], linestyle=styles[_rate(r)], label=f"{_method(r)}, {_rate(r)}")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (s)")
    ax.legend(fontsize=7, ncol=2)


def plot(rows: Sequence[dict], path: Path, log: Callable[[str], None] = print) -> None:
    """A panel per workload and restart (or not) between the rounds. Long-doc-qa: the query round's
    mean TTFT per method, a bar per link rate (the TTFT gain over the warm-up on each); multi-round:
    mean TTFT per turn, a colour per method, a line style per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    methods = list(dict.fromkeys(_method(r) for r in rows))
    rates = list(dict.fromkeys(_rate(r) for r in sorted(rows, key=lambda r: r.get("bandwidth_mbps") or 0)))
    colour = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    styles = {rate: ("-", "--", ":", "-.")[i % 4] for i, rate in enumerate(rates)}
    columns = 2 if len(panels) > 1 else 1
    lines = max(1, -(-len(panels) // columns))
    fig, axes = plt.subplots(lines, columns, figsize=(7 * columns, 4.6 * lines), squeeze=False)
    for ax, (workload, restart, chosen) in zip(list(axes.flat)[:len(panels)], panels, strict=True):
        when = "after a restart between the rounds" if restart else "one server for both rounds"
        if workload == "long-doc-qa":
            _query_bars(ax, chosen, rates, colour)
            ax.set_title(f"long-doc-qa, {when}", fontsize=10)
        else:
            _turn_lines(ax, chosen, colour, styles)
            ax.set_title(f"multi-round by turn, {when}", fontsize=10)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot: {path}")


def summary(row: dict) -> Dict[str, object]:
    """The row without its requests (what the command prints)."""
    return {k: v for k, v in row.items() if k != "requests"}
