"""The alert rules: promtool checks them, their unit tests pass, and every alert is tested both ways."""

from __future__ import annotations

import subprocess

import yaml
from deploy_support import DEPLOY

RULES = DEPLOY / "prometheus" / "rules.yaml"
TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yaml"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)


def test_promtool_check_rules(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert TESTS, "no rule unit tests in deploy/prometheus/tests"
    out = run(promtool, "test", "rules", *map(str, TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    fires, silent = set(), set()
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts - fires == set(), f"alerts never tested firing: {sorted(alerts - fires)}"
    assert alerts - silent == set(), f"alerts never tested silent: {sorted(alerts - silent)}"
    assert (fires | silent) <= alerts, f"tests name unknown alerts: {sorted((fires | silent) - alerts)}"


def test_every_alert_has_severity_and_summary() -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
