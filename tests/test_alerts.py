"""Alerts and dashboard: promtool checks and unit-tests the rules; every metric named is a pinned one."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MON = ROOT / "monitoring"
DESIGN = ROOT.parent / "shared" / "DESIGN.md"

# DESIGN.md's pinned metric names (checked against DESIGN.md itself when it is present).
PINNED = {
    "lockstep_agreement_wait_seconds", "lockstep_agreements_stalled", "lockstep_agreement_stalls_total",
    "lockstep_rank_pages", "lockstep_free_page_skew_pages", "lockstep_prefix_offered_pages_total",
    "lockstep_prefix_agreed_pages_total", "lockstep_admission_deferred_total", "lockstep_preemptions_total",
    "lockstep_requests", "lockstep_time_to_first_token_seconds", "lockstep_inter_token_latency_seconds",
    "lockstep_request_duration_seconds", "lockstep_prompt_tokens_total", "lockstep_generation_tokens_total",
    "lockstep_prefix_cache_hit_tokens_total", "lockstep_step_duration_seconds", "lockstep_rank_up",
    "lockstep_rebalances_total", "lockstep_requests_migrated_total", "lockstep_requests_dropped_total",
    "lockstep_routing_decisions_total", "lockstep_rank_pool_pages", "lockstep_routing_expected_hit_tokens_total",
    "lockstep_routing_agreed_hit_tokens_total", "lockstep_coordinator_seconds_total",
    "lockstep_requests_rejected_total", "lockstep_prefix_cache_queried_tokens_total",
}
# exported beyond DESIGN.md's pinned contract, documented in the README
OURS = {"lockstep_rank_pool_pages", "lockstep_routing_expected_hit_tokens_total",
        "lockstep_routing_agreed_hit_tokens_total", "lockstep_coordinator_seconds_total",
        "lockstep_requests_rejected_total", "lockstep_prefix_cache_queried_tokens_total"}
HISTOGRAMS = {"lockstep_agreement_wait_seconds", "lockstep_time_to_first_token_seconds",
              "lockstep_inter_token_latency_seconds", "lockstep_request_duration_seconds",
              "lockstep_step_duration_seconds"}
ALERTS = ["LockstepAgreementStalled", "LockstepFreePageSkewHigh", "LockstepRankDown", "LockstepGroupNotReady",
          "LockstepWaitingQueueBackingUp", "LockstepKVPoolNearlyFull", "LockstepPreemptionsHigh",
          "LockstepPoolTotalsDiverged", "LockstepRequestsDropped", "LockstepRequestsRejected",
          "LockstepCoordinatorDown", "LockstepCoordinatorAbsent"]

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian package "
                                    "`prometheus`; .ci/run installs it)")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((MON / "alerts.yaml").read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((MON / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression, with histogram/summary suffixes folded to the family."""
    names = set()
    for name in re.findall(r"\blockstep_[a-z_]+", expr):
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


@needs_promtool
def test_promtool_check_rules() -> None:
    out = subprocess.run([promtool, "check", "rules", str(MON / "alerts.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


@needs_promtool
def test_promtool_unit_tests() -> None:
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=MON, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load((MON / "alerts_test.yaml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert {a: cases.get(a) for a in ALERTS} == {a: {True, False} for a in ALERTS}


def test_alerts_are_complete() -> None:
    runbook = (ROOT / "docs/runbook.md").read_text()
    anchors = {h.strip().lower().replace(" ", "-") for h in re.findall(r"^## (.+)$", runbook, re.M)}
    assert [r["alert"] for r in rules()] == ALERTS
    for r in rules():
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        anchor = r["annotations"]["runbook_url"].split("docs/runbook.md#")[1]
        assert anchor in anchors, f"{r['alert']}: no section for #{anchor} in docs/runbook.md"
    severity = {r["alert"]: r["labels"]["severity"] for r in rules()}
    assert severity["LockstepAgreementStalled"] == severity["LockstepPoolTotalsDiverged"] == "critical"
    # Requests lost (DESIGN.md: must stay 0), and the coordinator itself gone: without it no other alert fires.
    assert severity["LockstepRequestsDropped"] == "critical"
    assert severity["LockstepCoordinatorDown"] == severity["LockstepCoordinatorAbsent"] == "critical"


def test_every_metric_in_alerts_and_dashboard_is_pinned() -> None:
    used = set()
    for expr in [r["expr"] for r in rules()] + dashboard_exprs():
        names = metric_names(expr)
        # `up`, Prometheus' own series of each target, is what the coordinator-down rules read
        assert names or re.search(r"\bup\{", expr), f"no lockstep metric in {expr!r}"
        used |= names
    assert used <= PINNED, f"not exported by lockstep: {sorted(used - PINNED)}"


def test_pinned_list_matches_design() -> None:
    if not DESIGN.exists():
        pytest.skip(f"{DESIGN} is not in this checkout")
    section = DESIGN.read_text().split("Metrics (Prometheus")[1].split("Kubernetes:")[0]
    # DESIGN.md pins the contract; what we export beyond it (OURS) is ours to document
    assert set(re.findall(r"`(lockstep_[a-z_]+)`", section)) == PINNED - OURS


def test_dashboard_has_the_panels_and_variables() -> None:
    dash = json.loads((MON / "dashboard.json").read_text())
    titles = {p["title"] for p in dash["panels"]}
    assert titles == {
        "Request rate", "Time to first token", "Inter-token latency", "End-to-end latency", "Tokens/s",
        "Running and waiting requests", "Prefix-cache hit rate", "KV pages by state per rank",
        "Free-page skew per group", "Agreement wait", "Stalled agreements", "Preemptions", "Step time",
        "Ranks up", "Group $group", "Group $group: routed requests", "Group $group: time to first token",
        "Group $group: ranks up and requests", "KV pool split per rank", "Rebalances",
        "Group $group: routing hit tokens, expected vs agreed"}
    assert [p.get("repeat") for p in dash["panels"] if p["type"] == "row"] == ["group"]  # one row per group
    assert {v["name"] for v in dash["templating"]["list"]} >= {"namespace", "deployment", "group"}
    for p in dash["panels"]:
        for t in p.get("targets", []):  # a row holds no query
            assert all(f"=~\"${v}\"" in t["expr"] for v in ("namespace", "deployment", "group")), p["title"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
