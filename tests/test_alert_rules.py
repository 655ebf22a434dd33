"""The example alert rules (deploy/prometheus/kvpush-alerts.yaml) parse, and every metric
they name is one the router or a sidecar exports, with the labels the rules use."""

from __future__ import annotations

import pathlib
import re

import yaml

from kvpush.router import metrics as router_metrics
from kvpush.sidecar.metrics import SidecarMetrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, of everything the router and a sidecar export."""
    sidecar = SidecarMetrics("prefill", lambda: {"staging_units": 4, "staging_free_units": 4, "connected": True})
    sidecar.failures.labels("prefill", "timeout").inc()
    decode = SidecarMetrics("decode", lambda: {"landing_blocks": 4, "landing_blocks_landed": 0,
                                               "recomputes": {"timeout": 1}, "prefix_blocks_held": 0,
                                               "prefix_events": {}, "prefix_unusable": "",
                                               "prefix_reports": {"snapshots": 0}})
    decode.landings.labels("CONSUMED")
    router_metrics.FALLBACKS.labels("no_capacity")
    router_metrics.REQUESTS.labels("completions", "ok")
    out: dict[str, set[str]] = {}
    for registry in (router_metrics.REGISTRY, sidecar.registry, decode.registry):
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_every_metric_an_alert_names_is_exported_with_its_labels():
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kvpush-alerts.yaml").read_text())
    names = exported()
    checked = 0
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
            for metric in re.findall(r"\bkvpush_[a-z_]+\b", rule["expr"]):
                assert metric in names, f"{rule['alert']}: {metric} is not exported"
                for label in re.findall(rf"{metric}\{{(\w+)=", rule["expr"]):
                    assert label in names[metric], f"{rule['alert']}: {metric} has no label {label}"
                checked += 1
            for label in re.findall(r"by \(([\w, ]+)\)", rule["expr"]):
                # (instance and job: the target's labels, which Prometheus adds as it scrapes)
                wanted = {x.strip() for x in label.split(",")} - {"le", "instance", "job"}
                assert any(wanted <= names[m] for m in re.findall(r"\bkvpush_[a-z_]+\b", rule["expr"])), rule["alert"]
    assert checked >= 6
