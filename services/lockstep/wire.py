"""Plans, reports and rank infos to and from their protobuf messages: the one translation at the services'
edges.

The cores speak `lockstep.steps`; only the rank and coordinator services see protobuf. Every field
crosses both ways unchanged (`x == from_proto(to_proto(x))`), so nothing a rank decides on can be
lost or rounded in transit. A message that cannot be a plan (a negative step, a chunk without
tokens, a page key that is not bytes) raises `WireError` naming the field, on either side, so a bad
plan is refused as a whole instead of being half carried out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lockstep.chunk_checks import chunk_error, columns_pass, sampling_error
from lockstep.chunk_columns import ChunkColumns
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import (
    Admit,
    Chunk,
    Plan,
    PoolState,
    Probe,
    ProbeAnswer,
    PromptLogprobs,
    RankInfo,
    Report,
    Sampled,
    SamplingParams,
    Timings,
    TokenLogprobs,
)


class WireError(ValueError):
    """A message that does not translate: the text names the step and the field."""


def _keys(keys: Iterable[bytes], where: str) -> list[bytes]:
    keys = list(keys)
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise WireError(f"{where}[{i}]: page keys are bytes, got {type(key).__name__}")
        if not key:
            raise WireError(f"{where}[{i}]: empty page key")
    return keys


def _request_id(request_id: str, where: str) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise WireError(f"{where}: request_id must be a non-empty string, got {request_id!r}")
    return request_id


def _check_batch(batch: Sequence[Chunk], where: str) -> None:
    """Every chunk, with each distinct sampling checked once (a decode step repeats every request's) and the
    message, which names the chunk, formatted only for one that fails. Columns that pass `columns_pass` are
    not read a chunk at a time."""
    if isinstance(batch, ChunkColumns) and columns_pass(batch):
        return
    distinct = {id(c.sampling): c.sampling for c in batch}
    sampling_errors = {key: sampling_error(sampling) for key, sampling in distinct.items()}
    for i, c in enumerate(batch):
        why = chunk_error(c) or sampling_errors[id(c.sampling)]
        if why:
            at = f"{where} batch[{i}]"
            _request_id(c.request_id, at)
            raise WireError(f"{at} ({c.request_id!r}): {why}")


def _check_plan(plan: Plan) -> None:
    if plan.step < 0:
        raise WireError(f"plan step must be >= 0, got {plan.step}")
    where = f"plan {plan.step}"
    for i, rid in enumerate(plan.releases):
        _request_id(rid, f"{where} releases[{i}]")
    for i, admit in enumerate(plan.admits):
        _request_id(admit.request_id, f"{where} admits[{i}]")
        _keys(admit.prefix_keys, f"{where} admits[{i}].prefix_keys")
    _check_batch(plan.batch, where)
    for i, probe in enumerate(plan.probes):
        _request_id(probe.request_id, f"{where} probes[{i}]")
        _keys(probe.keys, f"{where} probes[{i}].keys")


def _penalties_to_proto(m: pb.SamplingParamsMsg, s: SamplingParams) -> None:
    """The penalty fields, each only where it is not off (a plain request's message stays as it was)."""
    if s.repetition_penalty != 1.0:
        m.repetition_penalty = s.repetition_penalty
    m.frequency_penalty = s.frequency_penalty
    m.presence_penalty = s.presence_penalty
    for token, bias in s.logit_bias:
        m.logit_bias[token] = bias
    m.min_tokens = s.min_tokens
    m.stop_token_ids.extend(s.stop_token_ids)


def plan_to_proto(plan: Plan) -> pb.PlanMsg:
    """The message the coordinator sends every rank for one step."""
    _check_plan(plan)
    try:
        msg = pb.PlanMsg(
            step=plan.step,
            releases=list(plan.releases),
            flush_prefix_cache=plan.flush_prefix_cache,
            release_all=plan.release_all,
            abstain=plan.abstain,
            pool_split=dict(plan.pool_split),
            pool_fence=dict(plan.pool_fence),
        )
        for admit in plan.admits:
            msg.admits.add(request_id=admit.request_id, prefix_keys=list(admit.prefix_keys))
        _batch_to_proto(msg, ChunkColumns.of(plan.batch))  # the scheduler's plans are columns already
        for probe in plan.probes:
            msg.probes.add(request_id=probe.request_id, keys=list(probe.keys))
    except (TypeError, ValueError) as e:
        raise WireError(f"plan {plan.step} does not fit its message: {e}") from e
    return msg


def _batch_to_proto(msg: pb.PlanMsg, cols: ChunkColumns) -> None:
    """The chunks as BatchMsg columns, each distinct sampling once in `msg.samplings`."""
    b = msg.batch
    table: dict[SamplingParams, int] = {}
    refs = [table.setdefault(s, len(table)) for s in cols.sampling]
    for i, (prompt_logprobs, next_token_id, history) in cols.extras.items():
        extra = b.extras[i]
        if prompt_logprobs != -1:
            extra.prompt_logprobs = prompt_logprobs
        if next_token_id != -1:
            extra.next_token_id = next_token_id
        if history is not None:
            extra.history.SetInParent()
            extra.history.token_ids.extend(history)
    b.request_ids.extend(cols.request_ids)
    b.token_counts.extend(cols.token_counts)
    b.token_ids.extend(cols.token_ids)
    b.starts.extend(cols.starts)
    b.sample.extend(cols.sample)
    b.sample_index.extend(cols.sample_index)
    b.sampling.extend(refs)
    blobs = list(map(_SAMPLING_SENT.get, table))
    msg.samplings.extend(blobs if None not in blobs else [sampling_bytes(s) for s in table])


_SAMPLING_SENT: dict[SamplingParams, bytes] = {}
_SAMPLING_SEEN: dict[bytes, SamplingParams] = {}
_SAMPLING_CACHE_MAX = 1 << 14  # distinct parameters: about one per request held


def sampling_bytes(s: SamplingParams) -> bytes:
    """The serialized SamplingParamsMsg: built once per distinct parameters (a request keeps its own, seed and
    all, for its whole life), not once per step."""
    found = _SAMPLING_SENT.get(s)
    if found is None:
        if len(_SAMPLING_SENT) >= _SAMPLING_CACHE_MAX:
            _SAMPLING_SENT.clear()
        m = pb.SamplingParamsMsg(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        if s.seed is not None:
            m.seed = s.seed
        if s.logprobs != -1:
            m.logprobs = s.logprobs
        if s.prompt_logprobs != -1:
            m.prompt_logprobs = s.prompt_logprobs
        _penalties_to_proto(m, s)
        found = _SAMPLING_SENT[s] = m.SerializeToString(deterministic=True)
    return found


def sampling_from_bytes(raw: bytes) -> SamplingParams:
    """A plan's sampling parameters from their serialized message, built once per distinct bytes."""
    found = _SAMPLING_SEEN.get(raw)
    if found is None:
        try:
            s = pb.SamplingParamsMsg.FromString(raw)
        except Exception as e:  # protobuf's DecodeError: a WireError like any other bad field
            raise WireError(f"sampling parameters that do not parse: {e}") from e
        if len(_SAMPLING_SEEN) >= _SAMPLING_CACHE_MAX:
            _SAMPLING_SEEN.clear()
        found = _SAMPLING_SEEN[raw] = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            logprobs=s.logprobs if s.HasField("logprobs") else -1,
            prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else -1,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            logit_bias=tuple(s.logit_bias.items()),
            min_tokens=s.min_tokens,
            stop_token_ids=tuple(s.stop_token_ids),
        )
    return found


def _batch_from_proto(msg: pb.PlanMsg) -> ChunkColumns:
    """BatchMsg's columns as a rank keeps them (the per-chunk checks follow in `_check_plan`)."""
    rids, counts, tokens, starts, samples, indexes, refs = _columns(msg)
    samplings = [sampling_from_bytes(s) for s in msg.samplings] or [SamplingParams()]
    if refs and not 0 <= min(refs) <= max(refs) < len(samplings):
        raise WireError(f"plan {msg.step} batch: sampling references {min(refs)}..{max(refs)} outside the plan's "
                        f"{len(samplings)} sampling parameters")
    extras = {}
    for i, extra in msg.batch.extras.items():
        if not 0 <= i < len(rids):
            raise WireError(f"plan {msg.step} batch: extras for chunk {i} of {len(rids)}")
        extras[i] = (extra.prompt_logprobs if extra.HasField("prompt_logprobs") else -1,
                     extra.next_token_id if extra.HasField("next_token_id") else -1,
                     tuple(extra.history.token_ids) if extra.HasField("history") else None)
    return ChunkColumns(rids, counts, tokens, starts, samples, indexes, [samplings[r] for r in refs], extras)


def _columns(msg: pb.PlanMsg) -> tuple[list, ...]:
    """BatchMsg's columns as lists; columns of different lengths, or token counts that do not add up to the
    tokens, are a WireError."""
    b = msg.batch
    rids, counts, tokens, starts = list(b.request_ids), list(b.token_counts), list(b.token_ids), list(b.starts)
    samples, indexes, refs = list(b.sample), list(b.sample_index), list(b.sampling)
    n = len(rids)
    if any(len(col) != n for col in (counts, starts, samples, indexes, refs)):
        raise WireError(f"plan {msg.step} batch: its columns differ in length ({n} request ids, {len(counts)} token "
                        f"counts, {len(starts)} starts, {len(samples)} sample flags, {len(indexes)} sample indexes, "
                        f"{len(refs)} sampling references)")
    if n and (min(counts) < 0 or sum(counts) != len(tokens)):
        raise WireError(f"plan {msg.step} batch: token counts summing to {sum(counts)} (min {min(counts)}) for "
                        f"{len(tokens)} tokens")
    return rids, counts, tokens, starts, samples, indexes, refs


def plan_from_proto(msg: pb.PlanMsg) -> Plan:
    """The plan a rank carries out; raises WireError for a message that cannot be a plan."""
    plan = Plan(
        step=msg.step,
        releases=tuple(msg.releases),
        admits=tuple(Admit(a.request_id, tuple(a.prefix_keys)) for a in msg.admits),
        batch=_batch_from_proto(msg),
        probes=tuple(Probe(p.request_id, tuple(p.keys)) for p in msg.probes),
        flush_prefix_cache=msg.flush_prefix_cache,
        release_all=msg.release_all,
        abstain=msg.abstain,
        pool_split=tuple(sorted(msg.pool_split.items())),
        pool_fence=tuple(sorted(msg.pool_fence.items())),
    )
    _check_plan(plan)
    return plan


# Timings travel as a map named by the rank; these are the names (rank_step_s keeps its older wire name).
TIMING_NAMES = {"step_s": "step_s", "forward_s": "forward_s", "rank_step_s": "rank_step_seconds"}


def report_to_proto(report: Report) -> pb.ReportMsg:
    """The message a rank answers one plan with."""
    try:
        msg = pb.ReportMsg(step=report.step, rank=report.rank, error=report.error)
        msg.sampled_ids.extend([s.request_id for s in report.sampled])
        msg.sampled_tokens.extend([s.token_id for s in report.sampled])
        for i, s in enumerate(report.sampled):
            if s.logprobs is not None:
                m = msg.sampled_logprobs[i]
                m.logprob = s.logprobs.logprob
                m.top_ids.extend(t for t, _ in s.logprobs.top)
                m.top_logprobs.extend(lp for _, lp in s.logprobs.top)
        for pl in report.prompt_logprobs:
            _add_prompt_logprobs(msg.prompt_logprobs.add(request_id=pl.request_id, start=pl.start), pl)
        for p in report.probes:
            msg.probes.add(
                request_id=p.request_id, matched_pages=p.matched_pages, pinned_pages=p.pinned_pages,
                sliding_runs=[x for run in p.sliding_runs for x in run], sliding_pinned=p.sliding_pinned,
            )
        for p in report.pools:
            msg.pools.add(
                pool=p.pool, total=p.total, free=p.free, evictable=p.evictable, used=p.used, pinned=p.pinned,
                movable=p.movable, fenced=p.fenced,
            )
        for name, key in TIMING_NAMES.items():
            seconds = getattr(report.timings, name)
            if seconds:
                msg.timings[key] = seconds
    except (TypeError, ValueError) as e:
        raise WireError(
            f"report of step {report.step} from rank {report.rank} does not fit its message: {e}"
        ) from e
    return msg


def _add_prompt_logprobs(m: pb.PromptLogprobsMsg, pl: PromptLogprobs) -> None:
    if any(e.rank for e in pl.entries):
        m.ranks.extend(e.rank for e in pl.entries)
    for e in pl.entries:
        m.logprobs.append(e.logprob)
        m.top_counts.append(len(e.top))
        m.top_ids.extend(i for i, _ in e.top)
        m.top_logprobs.extend(lp for _, lp in e.top)


def report_from_proto(msg: pb.ReportMsg) -> Report:
    """The report the coordinator decides from; a timing the rank did not send is 0.0, one it does not
    know of is dropped."""
    return Report(
        step=msg.step,
        rank=msg.rank,
        sampled=_sampled(msg),
        probes=tuple(_probe_answer(p) for p in msg.probes),
        pools=tuple(PoolState(p.pool, p.total, p.free, p.evictable, p.used, p.pinned, p.movable, p.fenced)
                    for p in msg.pools),
        error=msg.error,
        timings=Timings(**{name: msg.timings.get(key, 0.0) for name, key in TIMING_NAMES.items()}),
        prompt_logprobs=tuple(_prompt_logprobs(m) for m in msg.prompt_logprobs),
    )


def _prompt_logprobs(msg: pb.PromptLogprobsMsg) -> PromptLogprobs:
    counts = list(msg.top_counts)
    if len(counts) != len(msg.logprobs) or any(n < 0 for n in counts) or sum(counts) != len(msg.top_ids) \
            or len(msg.top_ids) != len(msg.top_logprobs) or len(msg.ranks) not in (0, len(counts)):
        raise WireError(f"prompt logprobs of {msg.request_id}: {len(msg.logprobs)} entries, top counts {counts[:8]}, "
                        f"{len(msg.top_ids)} top ids and {len(msg.top_logprobs)} top logprobs do not match")
    entries, at = [], 0
    ranks = list(msg.ranks) or [0] * len(counts)
    for lp, n, rank in zip(msg.logprobs, counts, ranks, strict=True):
        entries.append(TokenLogprobs(lp, tuple(zip(msg.top_ids[at:at + n], msg.top_logprobs[at:at + n], strict=True)),
                                     rank))
        at += n
    return PromptLogprobs(msg.request_id, msg.start, tuple(entries))


def _sampled(msg: pb.ReportMsg) -> tuple[Sampled, ...]:
    ids, tokens = list(msg.sampled_ids), list(msg.sampled_tokens)
    if len(ids) != len(tokens):
        raise WireError(f"report of step {msg.step}: {len(ids)} sampled request ids but {len(tokens)} tokens")
    sampled = [Sampled(r, t) for r, t in zip(ids, tokens, strict=True)]
    for i, lp in msg.sampled_logprobs.items():
        if not 0 <= i < len(ids):
            raise WireError(f"report of step {msg.step}: logprobs for sampled token {i} of {len(ids)}")
        if len(lp.top_ids) != len(lp.top_logprobs):
            raise WireError(f"sampled {ids[i]}: {len(lp.top_ids)} top ids but {len(lp.top_logprobs)} logprobs")
        top = tuple(zip(lp.top_ids, lp.top_logprobs, strict=True))
        sampled[i] = Sampled(ids[i], tokens[i], TokenLogprobs(lp.logprob, top))
    return tuple(sampled)


def _probe_answer(msg: pb.ProbeAnswerMsg) -> ProbeAnswer:
    runs = list(msg.sliding_runs)
    if len(runs) % 2:
        raise WireError(f"probe answer for {msg.request_id}: sliding_runs holds {len(runs)} numbers, not pairs")
    return ProbeAnswer(msg.request_id, msg.matched_pages, msg.pinned_pages,
                       tuple(zip(runs[::2], runs[1::2], strict=True)), msg.sliding_pinned)


def info_to_proto(info: RankInfo) -> pb.RankInfo:
    """What a rank serves, as the Info call answers it."""
    try:
        return pb.RankInfo(
            rank=info.rank,
            world_size=info.world_size,
            model_id=info.model_id,
            page_size=info.page_size,
            pool_totals=info.pool_totals,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            last_step=info.last_step,
            sliding_window=info.sliding_window,
            pool_page_bytes=dict(info.page_bytes),
        )
    except (TypeError, ValueError) as e:
        raise WireError(f"rank info does not fit RankInfo: {e}") from e


def info_from_proto(msg: pb.RankInfo) -> RankInfo:
    """The Info answer as the coordinator checks it (`last_step` -1: the rank has carried out no step)."""
    return RankInfo(
        rank=msg.rank,
        world_size=msg.world_size,
        model_id=msg.model_id,
        page_size=msg.page_size,
        pools=tuple(msg.pool_totals.items()),
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        last_step=msg.last_step,
        sliding_window=msg.sliding_window,
        page_bytes=tuple(msg.pool_page_bytes.items()),
    )
