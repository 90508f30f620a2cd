"""GenerateSpec and TokenEvent to and from the frontend link's messages (proto/lockstep/v1/frontend.proto).

A step's events for one frontend travel as columns: request ids, token ids and cached-token counts, plus an
extras entry only for the few events that end a request, fail it or carry logprobs. At batch 256 that is one
message per step, not 256.
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.request import FinishReason
from lockstep.proto_gen.lockstep.v1 import frontend_pb2 as fpb
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import TokenLogprobs
from lockstep.wire import WireError, sampling_bytes, sampling_from_bytes

_REASONS = {r.value: r for r in FinishReason}
# A step's events go in messages of about MESSAGE_BUDGET bytes at most (prompt logprobs come whole with a
# request's first token, ~12 bytes per prompt position and top entry); one event alone may be larger, up to
# the link's MAX_MESSAGE (a 128k-token prompt's logprobs with 20 top entries each are ~32 MB).
MESSAGE_BUDGET = 8 << 20
MAX_MESSAGE = 512 << 20


def spec_to_proto(link_id: str, request_id: str, spec: GenerateSpec) -> fpb.SubmitMsg:
    """One choice's request (a spec of n > 1 is fanned out into choices before it is submitted)."""
    msg = fpb.SubmitMsg(link_id=link_id, request_id=request_id, prompt_ids=spec.prompt_ids, max_tokens=spec.max_tokens,
                        stop=spec.stop, stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos,
                        max_tokens_given=spec.max_tokens_given, include_stop_str=spec.include_stop_str,
                        echo_only=spec.echo_only, choice=spec.choice)
    msg.sampling.MergeFromString(sampling_bytes(spec.sampling))
    return msg


def spec_from_proto(msg: fpb.SubmitMsg) -> GenerateSpec:
    if not msg.request_id:
        raise WireError("a submitted request has no request id")
    return GenerateSpec(list(msg.prompt_ids), sampling_from_bytes(msg.sampling.SerializeToString()), msg.max_tokens,
                        list(msg.stop), list(msg.stop_token_ids), msg.ignore_eos, msg.max_tokens_given, 1,
                        msg.include_stop_str, msg.echo_only, msg.choice)


def answer_of(error: ApiError | None) -> fpb.SubmitAnswer:
    if error is None:
        return fpb.SubmitAnswer(ok=True)
    answer = fpb.SubmitAnswer(ok=False, status=error.status, message=error.message, param=error.param or "",
                              code=error.code or "", type=error.err_type)
    if error.retry_after is not None:
        answer.retry_after = error.retry_after
    return answer


def error_of(answer: fpb.SubmitAnswer) -> ApiError:
    """The coordinator's refusal, as the frontend's client gets it."""
    retry = answer.retry_after if answer.HasField("retry_after") else None
    return ApiError(answer.status, answer.message, answer.param or None, answer.code or None,
                    answer.type or "invalid_request_error", retry)


def split_events(events: Sequence[tuple[str, TokenEvent]], budget: int) -> list[Sequence[tuple[str, TokenEvent]]]:
    """The events in runs whose rough size stays within `budget` (a run of one may exceed it), in order. A step
    without prompt logprobs is one run, sized at no cost per event (this runs on the step loop for every step): its
    events are a few dozen bytes each, a few hundred with logprobs (at most --max-logprobs of them)."""
    if not any(ev.prompt_logprobs for _, ev in events):
        return [events]
    runs, start, size = [], 0, 0
    for i, (rid, ev) in enumerate(events):
        cost = 24 + len(rid) + _logprobs_size(ev.logprobs) + sum(_logprobs_size(lp) for lp in ev.prompt_logprobs or ())
        if size + cost > budget and i > start:
            runs.append(events[start:i])
            start, size = i, 0
        size += cost
    runs.append(events[start:])
    return runs


def _logprobs_size(lp: TokenLogprobs | None) -> int:
    return 0 if lp is None else 12 + 12 * len(lp.top)


def events_to_proto(events: Sequence[tuple[str, TokenEvent]]) -> fpb.StepEventsMsg:
    msg = fpb.StepEventsMsg(request_ids=[rid for rid, _ in events],
                            token_ids=[-1 if ev.token_id is None else ev.token_id for _, ev in events],
                            cached_tokens=[ev.cached_tokens for _, ev in events])
    for i, (_, ev) in enumerate(events):
        if ev.finish_reason is not None or ev.error or ev.logprobs is not None or ev.prompt_logprobs is not None:
            _add_extras(msg.extras.add(index=i), ev)
    return msg


def _add_extras(m: fpb.EventExtrasMsg, ev: TokenEvent) -> None:
    m.finish_reason = ev.finish_reason.value if ev.finish_reason is not None else ""
    m.error, m.status = ev.error, ev.status
    if ev.logprobs is not None:
        _logprobs_to_proto(m.logprobs, ev.logprobs)
    if ev.prompt_logprobs is not None:
        m.has_prompt_logprobs = True
        for lp in ev.prompt_logprobs:
            _logprobs_to_proto(m.prompt_logprobs.add(), lp)
        m.prompt_ranks.extend(lp.rank for lp in ev.prompt_logprobs)


def _logprobs_to_proto(m: pb.TokenLogprobsMsg, lp: TokenLogprobs) -> None:
    m.logprob = lp.logprob
    m.top_ids.extend(i for i, _ in lp.top)
    m.top_logprobs.extend(v for _, v in lp.top)


def events_from_proto(msg: fpb.StepEventsMsg) -> list[tuple[str, TokenEvent]]:
    n = len(msg.request_ids)
    if len(msg.token_ids) != n or len(msg.cached_tokens) != n:
        raise WireError(f"step events: {n} request ids, {len(msg.token_ids)} tokens, {len(msg.cached_tokens)} counts")
    events = [(rid, TokenEvent(None if t < 0 else t, None, c))
              for rid, t, c in zip(msg.request_ids, msg.token_ids, msg.cached_tokens, strict=True)]
    for m in msg.extras:
        if not 0 <= m.index < n:
            raise WireError(f"step events: extras for event {m.index} of {n}")
        rid, ev = events[m.index]
        events[m.index] = (rid, _with_extras(ev, m))
    return events


def _with_extras(ev: TokenEvent, m: fpb.EventExtrasMsg) -> TokenEvent:
    reason = _REASONS.get(m.finish_reason) if m.finish_reason else None
    if m.finish_reason and reason is None:
        raise WireError(f"step events: unknown finish reason {m.finish_reason!r}")
    prompt = None
    if m.has_prompt_logprobs:
        ranks = list(m.prompt_ranks) or [0] * len(m.prompt_logprobs)
        prompt = [_logprobs_from_proto(lp, rank) for lp, rank in zip(m.prompt_logprobs, ranks, strict=True)]
    return TokenEvent(ev.token_id, reason, ev.cached_tokens, m.error, m.status or 503,
                      _logprobs_from_proto(m.logprobs, 0) if m.HasField("logprobs") else None, prompt)


def _logprobs_from_proto(m: pb.TokenLogprobsMsg, rank: int) -> TokenLogprobs:
    if len(m.top_ids) != len(m.top_logprobs):
        raise WireError(f"logprobs: {len(m.top_ids)} top ids but {len(m.top_logprobs)} logprobs")
    return TokenLogprobs(m.logprob, tuple(zip(m.top_ids, m.top_logprobs, strict=True)), rank)
