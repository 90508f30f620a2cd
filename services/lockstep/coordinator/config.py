"""The coordinator's configuration: one object, validated once, read from flags and environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.coordinator.auth import parse_api_keys
from lockstep.coordinator.group_list import parse_group_list
from lockstep.coordinator.loop_watchdog import TICK_S as WATCHDOG_TICK_S
from lockstep.coordinator.rebalance import RebalancePolicy
from lockstep.coordinator.routing import POLICIES as ROUTING_POLICIES
from lockstep.coordinator.routing import parse_policy
from lockstep.rank_auth import COORDINATOR_SETTINGS as RANK_AUTH_SETTINGS
from lockstep.rank_auth import RankClientAuth, client_auth
from lockstep.settings import Setting, add_settings, at_least, integer, number, resolve, within

PORT = within(0, 65535)


def check_budget(max_num_batched_tokens: int, max_num_seqs: int,
                 names: tuple[str, str] = ("max_num_batched_tokens", "max_num_seqs")) -> None:
    """ValueError unless the step's token budget covers a decode token for every running request (vLLM refuses
    less too): no more than the budget could ever run at once. `names`: the two settings as the caller's user
    writes them."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"{names[0]} ({max_num_batched_tokens}) must be at least {names[1]} ({max_num_seqs}): "
                         f"every running request decodes a token per step, so no more than {names[0]} could ever "
                         f"run at once; lower --max-num-seqs or raise the budget")


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the coordinator of one or more groups needs besides the model's own files."""

    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    groups_file: str = ""  # re-read while running: groups come and go without a restart (coordinator/group_list.py)
    model: str = "builtin"
    served_model_name: str = ""
    host: str = "0.0.0.0"
    http_port: int = 8000
    http_keep_alive: float = 5.0  # seconds an idle HTTP connection stays open (uvicorn's and vLLM's default)
    grpc_port: int = 8001
    page_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0  # the most of a step one prefill chunk takes; 0: the whole budget
    max_waiting_requests: int = 1024
    stall_threshold: float = 5.0
    dead_rank_timeout: float = 30.0
    replay_timeout: float = 300.0
    prefix_caching: bool = True
    overlap: bool = True  # --no-overlap: build each plan only from the reports of the step before (no plan ahead)
    routing: str = "prefix"  # which group a new request goes to: `prefix` (cache-aware) or `least-loaded`
    rebalance_enabled: bool = True  # --no-rebalance: the pool split stays where the ranks started it
    rebalance_interval_steps: int = 10
    rebalance_cooldown: float = 120.0  # seconds, on the coordinator's clock
    rebalance_min_samples: int = 2000
    rebalance_threshold: float = 1.25
    shutdown_grace: float = 5.0  # seconds the requests in flight get on Ctrl-C / SIGTERM
    watchdog_timeout: float = 120.0  # seconds the event loop may stall before the process ends (0: never)
    api_workers: int = 0  # HTTP API frontend processes (api_workers.py); 0: the API runs in the coordinator's loop
    max_logprobs: int = 20  # the most logprobs/top_logprobs/prompt_logprobs a request may ask (vLLM's --max-logprobs)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # Bearer keys of the HTTP and gRPC APIs; none: open
    rank_auth: RankClientAuth = field(default_factory=RankClientAuth)  # group token and TLS towards the ranks

    def __post_init__(self) -> None:
        if type(self.max_logprobs) is not int or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs", "max_waiting_requests"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_budget(self.max_num_batched_tokens, self.max_num_seqs)
        if type(self.api_workers) is not int or not 0 <= self.api_workers <= 64:
            raise ValueError(f"api_workers must be an integer in [0, 64], got {self.api_workers!r}")
        if not 0 <= self.watchdog_timeout <= 86400 or 0 < self.watchdog_timeout <= WATCHDOG_TICK_S:
            raise ValueError(f"watchdog_timeout must be 0 (off) or in ({WATCHDOG_TICK_S:g}, 86400] seconds, got "
                             f"{self.watchdog_timeout!r}")
        if not self.stall_threshold > 0 or not self.dead_rank_timeout > 0 or not self.replay_timeout >= 0:
            raise ValueError("stall_threshold and dead_rank_timeout must be > 0 and replay_timeout >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        for name, addresses in self.groups.items():
            if not name or not addresses:
                raise ValueError(f"group {name!r} needs a name and at least one rank address")
        self.rebalance_policy  # noqa: B018 -- a bad policy is refused here, not at a group's first check

    @property
    def rebalance_policy(self) -> RebalancePolicy:
        """The settings every group's rebalance decision reads: one policy, so no group checks on its own terms."""
        return RebalancePolicy(enabled=self.rebalance_enabled, interval_steps=self.rebalance_interval_steps,
                               cooldown_s=self.rebalance_cooldown, min_samples=self.rebalance_min_samples,
                               threshold=self.rebalance_threshold)


SETTINGS = (
    Setting("model", "--model", "LOCKSTEP_MODEL", default="builtin",
            help="checkpoint directory, or 'builtin' (the coordinator reads only its config and tokenizer)"),
    Setting("served_model_name", "--served-model-name", "LOCKSTEP_SERVED_MODEL_NAME", default="",
            help="the name in /v1/models (default: the model directory's name)"),
    Setting("host", "--host", "LOCKSTEP_HOST", default="0.0.0.0", help="bind address"),
    Setting("http_port", "--http-port", "LOCKSTEP_HTTP_PORT", integer, 8000, "HTTP port", PORT),
    Setting("grpc_port", "--grpc-port", "LOCKSTEP_GRPC_PORT", integer, 8001, "gRPC inference port", PORT),
)
SCHEDULING = (
    Setting("page_size", "--page-size", "LOCKSTEP_PAGE_SIZE", integer, 16, "tokens per KV page", at_least(1)),
    Setting("max_num_batched_tokens", "--max-num-batched-tokens", "LOCKSTEP_MAX_BATCHED_TOKENS", integer, 512,
            "token budget of one step", at_least(1)),
    Setting("max_num_seqs", "--max-num-seqs", "LOCKSTEP_MAX_NUM_SEQS", integer, 64,
            "running requests per group", at_least(1)),
    Setting("long_prefill_token_threshold", "--long-prefill-token-threshold", "LOCKSTEP_LONG_PREFILL_TOKEN_THRESHOLD",
            integer, 0, "the most tokens of a step one request's prefill chunk takes, so short requests are "
            "admitted beside a long prompt (vLLM's); 0: a chunk may take the whole budget", at_least(0)),
    Setting("max_waiting_requests", "--max-waiting-requests", "LOCKSTEP_MAX_WAITING_REQUESTS", integer, 1024,
            "requests the coordinator keeps waiting (over all groups) before it answers 503 with Retry-After",
            at_least(1)),
    Setting("stall_threshold", "--stall-threshold", "LOCKSTEP_STALL_THRESHOLD_SECONDS", number, 5.0,
            "seconds after which an agreement wait counts as stalled", within(0, 86400, low_open=True)),
    Setting("dead_rank_timeout", "--dead-rank-timeout", "LOCKSTEP_DEAD_RANK_TIMEOUT_SECONDS", number, 30.0,
            "seconds after which a silent rank is dead", within(0, 86400, low_open=True)),
    Setting("replay_timeout", "--replay-timeout", "LOCKSTEP_REPLAY_TIMEOUT_SECONDS", number, 300.0,
            "how long the requests of a group that went down wait for a group to serve them "
            "(0: 503 at once when no other group is up)", within(0, 86400)),
    Setting("prefix_caching", "--no-prefix-caching", "LOCKSTEP_PREFIX_CACHING", default=True,
            help="turn prefix caching off", switch=True, flag_value=False),
    Setting("overlap", "--no-overlap", "LOCKSTEP_OVERLAP", default=True,
            help="turn overlap scheduling off (the next plan is built while the ranks run a step)", switch=True,
            flag_value=False),
    Setting("shutdown_grace", "--shutdown-grace", "LOCKSTEP_SHUTDOWN_GRACE_SECONDS", number, 5.0,
            "on Ctrl-C / SIGTERM, how long the requests in flight may still run before the coordinator stops "
            "(a second signal stops it at once)", within(0, 3600)),
    Setting("watchdog_timeout", "--watchdog-timeout", "LOCKSTEP_WATCHDOG_TIMEOUT_SECONDS", number, 120.0,
            "end the coordinator, with every thread's stack on stderr, when its event loop stalls this long, so "
            "that its supervisor starts it again instead of the ranks staying bound to a hung one (SGLang's flag); "
            "0: never", within(0, 86400)),
    Setting("max_logprobs", "--max-logprobs", "LOCKSTEP_MAX_LOGPROBS", integer, 20,
            "the most logprobs a request may ask for (completions' logprobs and prompt_logprobs, chat's "
            "top_logprobs); more is a 400 naming the field", at_least(0)),
    Setting("routing", "--routing", "LOCKSTEP_ROUTING", parse_policy, "prefix",
            "which group a new request goes to: 'prefix' (the group last sent its longest prefix, unless that "
            "group is far busier than the least loaded) or 'least-loaded'"),
)
# Where the HTTP API runs; the coordinator and `lockstep serve` take it.
FRONTENDS = (
    Setting("api_workers", "--api-workers", "LOCKSTEP_API_WORKERS", integer, 0,
            "serve the HTTP API from this many frontend processes sharing its port, each fed one message per "
            "step by the coordinator (vLLM's --api-server-count); 0: from the coordinator's own event loop",
            within(0, 64)),
    Setting("http_keep_alive", "--timeout-keep-alive", "LOCKSTEP_HTTP_TIMEOUT_KEEP_ALIVE", number, 5.0,
            "seconds an idle HTTP connection, or one that has not yet sent a whole request, stays open (vLLM's "
            "flag; behind a load balancer, set it above the balancer's idle timeout)", within(0, 86400, low_open=True)),
)
# The rebalance of a hybrid model's KV split (DESIGN.md "Rebalance agreement"); the coordinator and
# `lockstep serve` take these, the ranks never (they carry out the split the plan names).
REBALANCE = (
    Setting("rebalance_interval_steps", "--rebalance-interval-steps", "LOCKSTEP_REBALANCE_INTERVAL_STEPS", integer,
            10, "check whether to rebalance the KV pools at every plan step that is a multiple of this",
            at_least(1)),
    Setting("rebalance_cooldown", "--rebalance-cooldown", "LOCKSTEP_REBALANCE_COOLDOWN", number, 120.0,
            "seconds after a rebalance before the next one (the coordinator's clock)", at_least(0)),
    Setting("rebalance_min_samples", "--rebalance-min-samples", "LOCKSTEP_REBALANCE_MIN_SAMPLES", integer, 2000,
            "finished requests sampled since the last rebalance before the next one", at_least(0)),
    Setting("rebalance_threshold", "--rebalance-threshold", "LOCKSTEP_REBALANCE_THRESHOLD", number, 1.25,
            "rebalance only when a pool is off its target size by more than this ratio", at_least(1.0)),
    Setting("rebalance_enabled", "--no-rebalance", "LOCKSTEP_REBALANCE_ENABLED", default=True,
            help="never move the KV split between pools", switch=True, flag_value=False),
)


API_KEY_HELP = ("an API key clients must send as 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and "
                "/admin/* and as gRPC metadata (repeatable; env LOCKSTEP_API_KEY, comma-separated; default: none, "
                "an open API)")


def parse_groups(items: list[str]) -> dict[str, tuple[str, ...]]:
    """`g0=host:port,host:port` items (or one `LOCKSTEP_GROUPS` string joined by ';') -> name -> addresses."""
    groups = parse_group_list(";".join(item.replace("\n", ";") for item in items))  # checked as one list
    if not groups:
        raise ValueError("no group given: pass --group g0=HOST:PORT,... or --groups-file, or set LOCKSTEP_GROUPS")
    return groups


def read_groups(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[dict[str, tuple[str, ...]], str]:
    """The groups at start and the groups file to watch (""): from --groups-file / LOCKSTEP_GROUPS_FILE when
    given (then --group and LOCKSTEP_GROUPS must not be), else from --group / LOCKSTEP_GROUPS."""
    path = args.groups_file or env.get("LOCKSTEP_GROUPS_FILE", "")
    if not path:
        return parse_groups(args.group or [env.get("LOCKSTEP_GROUPS", "")]), ""
    if args.group or env.get("LOCKSTEP_GROUPS"):
        raise ValueError("give the groups either in a groups file (--groups-file / LOCKSTEP_GROUPS_FILE) or as "
                         "--group / LOCKSTEP_GROUPS, not both")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the groups file {path}: {exc}") from exc
    groups = parse_group_list(text)
    if not groups:
        raise ValueError(f"the groups file {path} lists no group")
    return groups, path


def parse_config(argv: list[str] | None, env: Mapping[str, str] | None = None) -> CoordinatorConfig:
    """`lockstep coordinator`'s flags and environment; exits with a message naming what is wrong."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="lockstep coordinator",
                                description="Connect to every rank of every group, then serve HTTP, gRPC "
                                            "and /metrics.")
    p.add_argument("--group", action="append", default=[],
                   help="NAME=HOST:PORT,HOST:PORT (ranks in order; repeatable; env LOCKSTEP_GROUPS, ';'-joined)")
    p.add_argument("--groups-file", default="", metavar="PATH",
                   help="a file of groups, one NAME=HOST:PORT,HOST:PORT a line, re-read while running: groups "
                        "added start, groups gone have their requests moved to the others first (env "
                        "LOCKSTEP_GROUPS_FILE; instead of --group)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help=API_KEY_HELP)
    add_settings(p, SETTINGS + SCHEDULING + FRONTENDS + REBALANCE + RANK_AUTH_SETTINGS)
    args = p.parse_args(argv)
    values = resolve(p, args, SETTINGS + SCHEDULING + FRONTENDS + REBALANCE, env)
    try:
        values["api_keys"] = parse_api_keys(args.api_key, env.get("LOCKSTEP_API_KEY", ""))
        values["rank_auth"] = client_auth(resolve(p, args, RANK_AUTH_SETTINGS, env), env)
        groups, groups_file = read_groups(args, env)
        config = CoordinatorConfig(groups=groups, groups_file=groups_file, **values)
    except ValueError as exc:
        p.error(str(exc))
    return config
