"""Generated docs stay true to the code: docs/configuration.md and docs/metrics.md equal what
``python -m kvrouter.docs`` makes now, every setting is described in the example config, and the
two Prometheus scrape configs name the same jobs."""

from __future__ import annotations

import yaml

from kvrouter import docs
from router.settings import Settings


def test_generated_docs_are_up_to_date() -> None:
    for path, text in docs.generated().items():
        assert path.exists(), f"{path.name} is missing: run `{docs.REGENERATE}`"
        assert path.read_text() == text, f"{path.name} is out of date: run `{docs.REGENERATE}`"


def test_every_setting_is_described_in_the_example_config() -> None:
    described = docs.example_descriptions(docs.EXAMPLE.read_text())
    missing = [
        key
        for key, _, _ in docs.settings_rows(Settings)
        if not described.get(key.replace("[].", "."), described.get(key))
    ]
    assert not missing, f"settings without a description in {docs.EXAMPLE.name}: {missing}"


def test_the_example_config_holds_every_default() -> None:
    """It says it is "a complete file with every default": a changed default, or a key left
    out, shows here (its workers are the example's own)."""
    import msgspec

    example = yaml.safe_load(docs.EXAMPLE.read_text())
    defaults = msgspec.to_builtins(Settings())
    example.pop("workers")
    defaults.pop("workers")
    assert example == defaults


def test_example_descriptions_follow_nesting_and_continuations() -> None:
    text = (
        "a: 1  # top\nb:\n  c: 2            # nested\n                    # more\nd: 3\n"
        "w:\n  - id: x   # name\n    u: 1    # url\n  - id: y\n"
    )
    assert docs.example_descriptions(text) == {
        "a": "top", "b": "", "b.c": "nested more", "d": "", "w": "", "w.id": "name", "w.u": "url"
    }  # fmt: skip


def test_metrics_doc_lists_the_families_the_dashboard_uses() -> None:
    names = {row[0] for row in docs.metric_rows()}
    for name in ("kvrouter_route_decisions_total", "kvrouter_event_lag_seconds",
                 "kvrouter_index_blocks", "kvrouter_worker_healthy"):  # fmt: skip
        assert name in names


def test_kubernetes_and_file_scrape_configs_have_the_same_jobs() -> None:
    obs = docs.ROOT / "deploy" / "observability"
    jobs = [
        [j["job_name"] for j in yaml.safe_load((obs / f).read_text())["scrape_configs"]]
        for f in ("prometheus.yml", "prometheus-kubernetes.yml")
    ]
    assert jobs[0] == jobs[1] == ["kvrouter-router", "kvrouter-workers"]


def test_code_points_to_the_projects_own_architecture_doc() -> None:
    """Docstrings cite docs/architecture.md (in this repo), never a design file outside it."""
    offenders = [
        str(p.relative_to(docs.ROOT))
        for pkg in ("indexer", "router", "engine", "kvrouter", "tests")
        for p in (docs.ROOT / pkg).rglob("*.py")
        if "DESIGN" in p.read_text() and p.name != "test_docs.py"
    ]
    assert not offenders, offenders
    assert (docs.ROOT / "docs" / "architecture.md").exists()
