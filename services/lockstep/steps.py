"""Plain data of the step protocol: what a plan tells every rank and what a rank reports back, what a
rank serves, and the rules by which a rank takes plans (`StepGate`).

These are the cores' types. The rank and coordinator services translate them to and from the
protobuf messages of `proto/` at their edges; nothing here imports torch, grpc or aiohttp, so the
coordinator's pure decisions and the engine share one vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

log = logging.getLogger("lockstep.steps")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int = -1  # -1: off; k >= 0: report the sampled token's logprob and the k most likely (TokenLogprobs)
    prompt_logprobs: int = -1  # -1: off; k >= 0: the prompt tokens' logprobs too (echo), each with the k most likely
    # vLLM's penalties and biases, applied to the logits before temperature, top-k and top-p (model/penalties.py):
    repetition_penalty: float = 1.0  # > 0; 1: off. Logits of tokens in the prompt or output: / r if > 0, else * r
    frequency_penalty: float = 0.0  # [-2, 2]; minus f times the token's count in the output
    presence_penalty: float = 0.0  # [-2, 2]; minus p for a token present in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit; kept sorted
    min_tokens: int = 0  # until this many tokens are generated, `stop_token_ids` cannot be sampled
    stop_token_ids: tuple[int, ...] = ()  # the ids min_tokens holds off (EOS unless ignore_eos, the client's)

    def __post_init__(self) -> None:
        # a list or dict given here would make two equal params differ (and the frozen class unhashable)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted({int(i): float(b) for i, b in bias}.items())))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        """Computed once: a plan's translation looks every chunk's parameters up by value (wire.py)."""
        return self._hash

    @property
    def needs_history(self) -> bool:
        """Whether the rank must know the request's tokens to sample it (repetition, frequency, presence)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (else they are sampled as the model gave them)."""
        return self.needs_history or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.stop_token_ids))


@dataclass(frozen=True)
class Admit:
    """Start holding a request: pin the first `len(prefix_keys)` pages of its chain.

    `prefix_keys` are the keys of the agreed prefix (L pages), computed by the coordinator; a rank
    that does not hold every one of them refuses the step instead of skipping a page.
    """

    request_id: str
    prefix_keys: tuple[bytes, ...] = ()


# A chunk's only token when the coordinator planned it before the token was sampled (overlap scheduling): "the token
# the sampling rank drew for this request at the step before", shared with every rank once the step is agreed.
PENDING_TOKEN = -1


@dataclass(slots=True)
class Chunk:
    """Tokens of one request to run this step: a prefill chunk or one decode token.

    Not frozen, though no one changes a chunk once built: a step builds one per running request on both sides
    of the wire, and a frozen dataclass's `__init__` costs about six times a slotted one's.

    `start` is the position of the first token; the rank holds positions [0, start) already.
    `sample` asks for a token from the logits of the chunk's last position; `sample_index` is how
    many tokens the request has generated before this one (it seeds per-request sampling, so a
    recompute after preemption draws the same tokens). `token_ids == (PENDING_TOKEN,)` is a decode planned
    while the step that samples its token still ran (`pending`).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    sample: bool = False
    sampling: SamplingParams = SamplingParams()
    sample_index: int = 0
    # k >= 0: score the prompt here: the logprob (and the k most likely) of the token after each position of
    # the chunk, the last position's being `next_token_id` (the prompt token after the chunk; -1: none)
    prompt_logprobs: int = -1
    next_token_id: int = -1
    # tokens [0, start) of the request, sent with a penalized request's first sampling chunk after admission
    # (SamplingParams.needs_history): the rank keeps its token counts from there (None: not sent)
    history: tuple[int, ...] | None = None

    @property
    def pending(self) -> bool:
        """Whether the token is the one the previous step sampled, not known when the plan was built."""
        return self.token_ids == (PENDING_TOKEN,)

    def resolved(self, token: int) -> Chunk:
        """This pending chunk with its token known (`dataclasses.replace`, spelled out: it runs per chunk)."""
        return Chunk(self.request_id, (token,), self.start, self.sample, self.sampling, self.sample_index,
                     self.prompt_logprobs, self.next_token_id, self.history)


@dataclass(frozen=True)
class Probe:
    """Ask how many leading pages of this chain a rank holds, and how many of those are pinned."""

    request_id: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class Plan:
    """Everything every rank does at one step, in the order of DESIGN.md's step protocol."""

    step: int
    releases: tuple[str, ...] = ()
    admits: tuple[Admit, ...] = ()
    batch: Sequence[Chunk] = ()  # a tuple, or ChunkColumns (as the scheduler builds and a rank reads it)
    probes: tuple[Probe, ...] = ()
    flush_prefix_cache: bool = False
    release_all: bool = False
    abstain: bool = False  # refuse this step and nothing else: catching up a rank left one step behind
    pool_split: tuple[tuple[str, int], ...] = ()  # a rebalance: every pool's new total; the plan holds no work
    pool_fence: tuple[tuple[str, int], ...] = ()  # pages at or above these are not handed out (in a work-free plan)


@dataclass(frozen=True)
class ProbeAnswer:
    """What one rank holds of a probed chain, by page identity.

    `matched_pages`: leading pages of the chain the `full` pool holds, `pinned_pages` of them referenced by
    live requests. With a `sliding` pool, `sliding_runs` are the runs [a, b) of chain pages that pool holds
    (any, not only leading ones: a window's pages outlive the pages before them) and `sliding_pinned` how
    many of those are referenced. The coordinator needs the identities, since the lengths a rank can
    serve are then not downward closed (docs/architecture.md).
    """

    request_id: str
    matched_pages: int
    pinned_pages: int
    sliding_runs: tuple[tuple[int, int], ...] = ()
    sliding_pinned: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sliding_runs", tuple((int(a), int(b)) for a, b in self.sliding_runs))

    def sliding_holds(self, first: int, end: int) -> bool:
        """Whether the sliding pool holds every chain page in [first, end)."""
        if first >= end:
            return True
        return any(a <= first and end <= b for a, b in self.sliding_runs)

    @property
    def sliding_held(self) -> int:
        """How many chain pages the sliding pool holds."""
        return sum(b - a for a, b in self.sliding_runs)


@dataclass(frozen=True)
class PoolState:
    """One KV pool's page counts. free + evictable + used + fenced == total, always."""

    pool: str
    total: int
    free: int
    evictable: int
    used: int
    pinned: int = 0
    # pages the pool could give up now: its top pages that no live request holds (derived: not compared)
    movable: int = field(default=0, compare=False)
    fenced: int = 0  # free pages above a fence, not handed out (a pool about to shrink); counted in none above


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the `top` most likely tokens as (id, logprob), most likely first.

    Of the model's raw logits (log_softmax before temperature, top-k and top-p: vLLM's default
    `logprobs_mode=raw_logprobs`), so a client can score text independently of how it was sampled.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # the token's rank in its distribution, 1 the most likely (vLLM's prompt_logprobs); 0: not computed

    def __post_init__(self) -> None:
        object.__setattr__(self, "top", tuple((int(i), float(lp)) for i, lp in self.top))
        object.__setattr__(self, "rank", int(self.rank))


@dataclass(slots=True)
class Sampled:
    """One request's sampled token; with `logprobs` when its chunk asked for them (SamplingParams.logprobs).

    Not frozen, though no one changes one once made (as `Chunk`): a step makes one per request on the sampling
    rank and again on the coordinator, and a frozen dataclass's `__init__` costs several times a slotted one's.
    """

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """A chunk's prompt scores (Chunk.prompt_logprobs): `entries[i]` is the logprob of the token at position
    `start + i + 1`, from the logits of position `start + i`. Of the raw logits, as TokenLogprobs."""

    request_id: str
    start: int
    entries: tuple[TokenLogprobs, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))


@dataclass(frozen=True)
class Timings:
    """Seconds one rank spent on one step, for the coordinator's step-time breakdown (0.0: not measured)."""

    # where the device runs ahead of the host (Engine.runs_ahead) both include preparing the next step, done while
    # this step's forward runs: the step after then counts no prepare of its own
    step_s: float = 0.0  # the engine's whole step, from the plan to its report
    forward_s: float = 0.0  # the forward pass and sampling
    rank_step_s: float = 0.0  # the rank service's handling of the plan, the engine's step included


@dataclass(frozen=True)
class Report:
    """What one rank says after carrying out plan `step`. `error` set means the step was refused.

    Built once, at the end of the step, and never changed: the same object answers a plan delivered again.
    """

    step: int
    rank: int
    sampled: tuple[Sampled, ...] = ()
    probes: tuple[ProbeAnswer, ...] = ()
    pools: tuple[PoolState, ...] = ()
    error: str = ""
    timings: Timings = Timings()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # one per chunk that asked (the prompt's, for echo)

    def __post_init__(self) -> None:
        # a list given here would make two equal reports differ
        for name in ("sampled", "probes", "pools", "prompt_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class RankInfo:
    """What a rank serves, as the coordinator checks it before it drives a group (the Info call).

    `pools` is (pool name, total pages) per pool, kept sorted by name (a mapping may be given);
    `sliding_window` is the window of the `sliding` pool's layers, which the coordinator needs to know
    which pages serve a prefix;
    `last_step` is the last step the rank carried out, -1 before its first or where the teller (the
    engine, which does not count steps) does not know it: the rank service fills it in.
    """

    rank: int
    world_size: int
    model_id: str
    page_size: int
    pools: tuple[tuple[str, int], ...]
    max_model_len: int
    vocab_size: int
    last_step: int = -1
    sliding_window: int = 0  # tokens a `sliding` pool's layers see; 0 when the rank has no such pool
    page_bytes: tuple[tuple[str, int], ...] = ()  # bytes one page of each pool takes: what a rebalance trades

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(sorted(dict(self.pools).items())))
        object.__setattr__(self, "page_bytes", tuple(sorted(dict(self.page_bytes).items())))

    @property
    def pool_totals(self) -> dict[str, int]:
        """Total pages of each pool, by name."""
        return dict(self.pools)


class StepGate:
    """The delivery rules of one rank's plans, in one place for the rank service and LocalGroup.

    Plans are carried out one at a time, in step order. The plan of the last step delivered again (a
    coordinator that resends after a reconnect) is answered with its report and never carried out twice:
    that would pin its prefixes twice. A different plan for that step, or a plan that skips or goes back a
    step, is refused without being run. The first plan may have any step: a coordinator that reconnects
    goes on from the step after the last one the rank carried out.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._plan: Plan | None = None
        self._report: Report | None = None

    @property
    def last_step(self) -> int:
        """The step of the last plan carried out, -1 before the first."""
        return -1 if self._plan is None else self._plan.step

    def deliver(
        self, plan: Plan, run: Callable[[Plan], Report], refuse: Callable[[Plan, str], Report]
    ) -> Report:
        """`run(plan)` if it is the next plan; the last report if it came again; else `refuse(plan, why)`."""
        last = self._plan
        if last is not None and plan.step == last.step:
            if plan == last:
                log.info("rank %d: step %d delivered again; answering from the last report", self.rank, plan.step)
                return self._report
            return refuse(plan, f"step {plan.step} was already carried out with a different plan")
        if last is not None and plan.step != last.step + 1:
            return refuse(plan, f"out of order: expected step {last.step + 1} (or {last.step} again), got {plan.step}")
        report = run(plan)
        self._plan, self._report = plan, report
        return report


class GroupBroken(RuntimeError):
    """A collective failed: this rank no longer knows where its peers are, so it must not serve on.

    torch.distributed groups cannot take a new member, so the only way back is a new group: the rank
    reports this and exits, and the operator (or `lockstep serve`) recreates the group as a whole.
    """
