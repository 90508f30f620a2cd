"""The alerts and the dashboard against a running group: every name exported, every query answered.

A rule or panel that names a series the coordinator does not export, or filters on a label the scrape
does not attach, fails silently in production. So this starts a real tp=2 group, sends traffic that
hits the prefix cache and makes the ranks' free pages differ, lets a real Prometheus scrape it every
second with the labels a ServiceMonitor attaches, loads the alert rules into it, and evaluates every
query of the dashboard and the rules there.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime
from http.client import HTTPConnection
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, http
from lockstep.local_group import free_port

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "monitoring" / "alerts.yaml"
DASHBOARD = ROOT / "monitoring" / "dashboard.json"

# What the chart's ServiceMonitor makes of the operator's coordinator Service `demo` in namespace `ml`:
# job is the Service's name, and the target carries namespace/service/pod/container/endpoint labels.
NAMESPACE, SERVICE, GROUP = "ml", "demo", "g0"
SCRAPE_LABELS = {"namespace": NAMESPACE, "service": SERVICE, "pod": f"{SERVICE}-coordinator-0",
                 "container": "coordinator", "endpoint": "http"}
VARIABLES = {"namespace": NAMESPACE, "deployment": SERVICE, "group": GROUP}

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                   "unless", "offset", "inf", "nan"}
SUFFIXES = ("_bucket", "_sum", "_count")
COMPARISON = re.compile(r"^(?P<expr>.*?)\s*(>=|<=|==|!=|>|<)\s*-?[\d.]+\s*$", re.DOTALL)


def panel_targets(panels: list[dict]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    out = []
    for p in panels:
        out += [(p.get("title", "?"), t["expr"]) for t in p.get("targets", []) if t.get("expr")]
        out += panel_targets(p.get("panels", []))
    return out


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def chart_alerts_text() -> str:
    """The rules as the chart ships them for its deployment `demo` in `ml`: LockstepCoordinatorAbsent's
    `up{job="lockstep"}` names that coordinator (templates/prometheusrule.yaml)."""
    text = ALERTS.read_text()
    assert 'absent(up{job="lockstep"})' in text
    return text.replace('up{job="lockstep"}', f'up{{namespace="{NAMESPACE}", job="{SERVICE}"}}')


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(chart_alerts_text())["groups"] for r in g["rules"]]


def substitute(expr: str, rate_interval: str = "10s") -> str:
    """Grafana's variables, with concrete values (longest names first: `$group` is not `$groups`)."""
    values = VARIABLES | {"__rate_interval": rate_interval}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unknown dashboard variable(s) {left} in {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group(0).lower() in PROMQL_KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_name_parser() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, kind) (rate(lockstep_x_bucket{job=~"a|b", le!="1"}[5m]))) '
            '/ on (group) group_left sum(lockstep_y) > bool 1e3 and lockstep_z offset 1m')
    assert metric_names(expr) == {"lockstep_x_bucket", "lockstep_y", "lockstep_z"}


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


CANCELLED = 6  # streams of the shared prompt whose client hangs up after the first token
FINISHED = 5


def cancel_after_first_token(group: Cluster, tokens: list[int]) -> None:
    conn = HTTPConnection("127.0.0.1", group.http_port, timeout=60)
    body = {"prompt": tokens, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.close()


def send_traffic(group: Cluster) -> None:
    """A repeated prompt (the prefix cache hits), streams of it cancelled after their first token (hits of
    requests that never finish), a few others, then flush rank 1 so its free pages differ."""
    def complete(tokens: list[int], n: int) -> dict:
        status, body = group.complete({"prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body

    shared = prompt(1, 40)
    complete(shared, 6)
    assert complete(shared, 6)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    for _ in range(CANCELLED):
        cancel_after_first_token(group, shared)
    group.assert_request_table_empty()
    for seed in (2, 3):
        complete(prompt(seed, 20 + 7 * seed), 5)
    status, body = http("POST", group.url + "/admin/reset_prefix_cache?rank=1")
    assert status == 200, body
    complete(prompt(4, 18), 4)


class Prometheus:
    """A real Prometheus server scraping one coordinator every second and evaluating the alert rules."""

    def __init__(self, binary: str, target_port: int, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(workdir / "alerts.yaml")],
            "scrape_configs": [{
                "job_name": SERVICE,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"], "labels": SCRAPE_LABELS}],
            }],
        }
        (workdir / "alerts.yaml").write_text(chart_alerts_text())
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        self._wait(lambda: http("GET", self.url + "/-/ready", timeout=2)[0] == 200, 60, "ready")

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if done():
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prometheus not {what} after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> dict:
        status, body = http("GET", f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10)
        assert status == 200 and isinstance(body, dict) and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict]:
        data = self.api("query", query=expr, time=f"{at:.3f}")
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def wait_scrapes(self, n: int, timeout: float = 30) -> None:
        """Until the coordinator target has been scraped successfully `n` times."""
        def scraped() -> bool:
            got = self.query(f'sum_over_time(up{{job="{SERVICE}"}}[1m])', time.time())
            return bool(got) and float(got[0]["value"][1]) >= n
        self._wait(scraped, timeout, f"scraping ({n} scrapes)")

    def wait_rules_evaluated(self, since: float, timeout: float = 30) -> list[dict]:
        """The rules, once every one of them has been evaluated after `since` (unix time)."""
        rules: list[dict] = []

        def evaluated() -> bool:
            nonlocal rules
            rules = [r for g in self.api("rules")["groups"] for r in g["rules"]]
            return bool(rules) and all(_unix(r["lastEvaluation"]) > since for r in rules)
        self._wait(evaluated, timeout, "evaluating rules")
        return rules

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _unix(rfc3339: str) -> float:
    """Prometheus' timestamps (nanosecond RFC 3339, `Z`) as unix seconds."""
    m = re.fullmatch(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert m, rfc3339
    base = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    return base.timestamp() + float(m.group(2) or 0)


@dataclass
class Live:
    group: Cluster
    metrics_text: str
    prom: Prometheus | None
    at: float  # when to evaluate: the rate windows ending here cover all of the traffic
    rate_interval: str  # `$__rate_interval`: at least 10 s, and longer than the traffic took

    def expr(self, expr: str) -> str:
        return substitute(expr, self.rate_interval)


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    torch.set_num_threads(1)
    group = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path_factory.mktemp("logs"))
    binary = shutil.which("prometheus")
    prom = None
    try:
        if binary:
            prom = Prometheus(binary, group.http_port, tmp_path_factory.mktemp("prometheus"))
            prom.wait_scrapes(3)
        start = time.time()
        send_traffic(group)
        end = time.time()
        # The window must hold a scrape before the first request and one after the last (1 s apart).
        window = max(10, math.ceil(end - start) + 4)
        at = end + 1.5
        if prom:
            while time.time() < at + 1.5:
                time.sleep(0.2)
        yield Live(group, group.metrics(), prom, at, f"{window}s")
    finally:
        if prom:
            prom.close()
        group.close()


needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed "
                                      "(Debian package `prometheus`; .ci/run installs it)")


def exported(text: str) -> tuple[set[str], dict[str, str]]:
    """Sample names and family name -> type of one /metrics page."""
    samples, families = set(), {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.type
        samples |= {s.name for s in fam.samples}
    return samples, families


def test_every_metric_named_in_rules_and_panels_is_exported(live: Live) -> None:
    samples, families = exported(live.metrics_text)
    exprs = [e for _, e in panel_targets(dashboard()["panels"])] + [r["expr"] for r in alert_rules()]
    exprs += [v["query"]["query"] for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    missing = {}
    for expr in exprs:
        names = metric_names(re.sub(r"label_values\((.*),\s*\w+\)", r"\1", substitute(expr)))
        assert names, f"no metric name found in {expr!r}"
        for name in names - {"up"}:  # Prometheus' own series of each target
            family = next((name[: -len(s)] for s in SUFFIXES
                           if name.endswith(s) and families.get(name[: -len(s)]) in ("histogram", "summary")),
                          name)
            if name not in samples or (family != name and family not in families):
                missing[name] = expr
    assert not missing, f"named but not exported by a running group: {missing}"


@needs_prometheus
def test_dashboard_variables_resolve_to_the_scraped_group(live: Live) -> None:
    """Grafana's label_values(selector, label), asked of Prometheus as the data source plugin asks it."""
    expected = {"namespace": NAMESPACE, "deployment": SERVICE, "group": GROUP}
    variables = [v for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} == set(expected)
    for v in variables:
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"].strip())
        assert m, v["query"]
        selector, label = substitute(m.group(1)), m.group(2)
        values = live.prom.api(f"label/{label}/values", **{"match[]": selector})
        assert values == [expected[v["name"]]], (v["name"], selector, values)


@needs_prometheus
def test_every_panel_query_returns_data(live: Live) -> None:
    empty, no_number = [], []
    for title, expr in panel_targets(dashboard()["panels"]):
        result = live.prom.query(live.expr(expr), live.at)
        if not result:
            empty.append((title, expr))
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            no_number.append((title, expr, result))
    assert not empty, f"panel queries with no series: {empty}"
    assert not no_number, f"panel queries with only NaN/Inf after traffic: {no_number}"


@needs_prometheus
def test_traffic_shows_on_the_panels(live: Live) -> None:
    """The values the traffic must move: requests, tokens, cache hits, and the skew of the flushed rank."""
    by_title: dict[str, list[str]] = {}
    for title, expr in panel_targets(dashboard()["panels"]):
        by_title.setdefault(title, []).append(live.expr(expr))

    def values(title: str) -> list[float]:
        assert title in by_title, f"no panel {title!r}"
        return [float(s["value"][1]) for e in by_title[title] for s in live.prom.query(e, live.at)]

    accepted, finished = values("Request rate")
    assert accepted > finished > 0
    assert accepted / finished == pytest.approx((FINISHED + CANCELLED) / FINISHED, rel=0.05)  # same window
    assert min(values("Tokens/s")) > 0
    # every admission's hits over its tokens: cancelled streams count in both (once over 1: hits of every
    # admission over the prompts of finished requests)
    assert 0 < min(values("Prefix-cache hit rate")) <= max(values("Prefix-cache hit rate")) < 1
    assert max(values("Free-page skew per group")) > 0
    assert values("Ranks up") == [2.0]


@needs_prometheus
def test_alert_rules_load_and_evaluate_healthy(live: Live) -> None:
    rules = live.prom.wait_rules_evaluated(since=live.at)
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
    unhealthy = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy
    firing = {r["name"]: r["state"] for r in rules if r["state"] != "inactive"}
    for name in ("LockstepRankDown", "LockstepGroupNotReady", "LockstepAgreementStalled", "LockstepRequestsDropped",
                 "LockstepCoordinatorDown", "LockstepCoordinatorAbsent"):
        assert name not in firing, f"{name} is {firing[name]} on a healthy group"


@needs_prometheus
def test_alert_expressions_select_the_live_series(live: Live) -> None:
    """Each rule's expression without its threshold has series: its labels and operands match for real."""
    for rule in alert_rules():
        absent = re.fullmatch(r"absent\((.*)\)", rule["expr"].strip(), re.DOTALL)
        if absent:  # says nothing while the series is there: the selector must find the live target
            assert not live.prom.query(rule["expr"], live.at), rule["alert"]
            result = live.prom.query(absent.group(1), live.at)
            assert [s["metric"].get("job") for s in result] == [SERVICE], (rule, result)
            continue
        m = COMPARISON.match(rule["expr"].strip())
        assert m, f"{rule['alert']}: expected `<expr> <op> <number>`, got {rule['expr']!r}"
        result = live.prom.query(m.group("expr"), live.at)
        assert result, f"{rule['alert']}: {m.group('expr')!r} selects nothing on a live group"
        for s in result:
            assert s["metric"].get("namespace") == NAMESPACE and s["metric"].get("job") == SERVICE, (rule, s)
