"""Reading metric names out of PromQL and Grafana dashboards, for the chart's metric checks."""
from __future__ import annotations

import re

PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "group", "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "clamp_min",
    "clamp_max", "clamp", "abs", "ceil", "floor", "round", "sort", "sort_desc", "vector", "scalar", "time",
    "absent", "label_replace", "label_join", "avg_over_time", "max_over_time", "min_over_time",
    "sum_over_time", "count_over_time", "last_over_time", "offset", "bool", "and", "or", "unless",
    "group_left", "group_right", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping
    clauses, functions and Grafana variables are not names)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)
    expr = re.sub(r"\blabel_values\(([^,)]*)(,[^)]*)?\)", r" \1 ", expr)   # Grafana's: (metric, label)
    names = re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def dashboard_queries(node) -> list[str]:
    """Every PromQL text of a Grafana dashboard: panel targets' `expr` and query variables."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                found.append(value["query"])
            else:
                found += dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            found += dashboard_queries(item)
    return found
