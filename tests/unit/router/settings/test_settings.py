"""Settings: YAML < env < flags, --worker specs, and errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import build_parser, settings_from_args
from router.errors import ConfigError
from router.settings import (
    DEFAULT_TIER_WEIGHTS,
    Settings,
    WorkerConfig,
    load_settings,
    parse_worker_spec,
)

ROOT = Path(__file__).resolve().parents[4]


def test_defaults():
    s = load_settings(environ={})
    assert s == Settings()
    assert (s.host, s.port, s.block_size, s.tokenizer) == ("127.0.0.1", 8000, 16, "byte")
    assert s.scoring.effective_tier_weights() == DEFAULT_TIER_WEIGHTS
    assert s.workers == []


def test_example_config_documents_every_key_and_loads():
    path = ROOT / "configs" / "router.example.yaml"
    s = load_settings(path, environ={})
    assert [w.id for w in s.workers] == ["w0", "w1"]
    assert s.workers[1].dp_ranks == 2 and s.workers[1].pool == "shared-redis"
    text = path.read_text()
    sections = ("server", "proxy", "health", "scoring", "route", "subscriber", "snapshot", "pd")
    for section in sections:
        sub = getattr(Settings(), section)
        for key in sub.__struct_fields__:
            assert f"{key}:" in text, f"{section}.{key} undocumented"
    for key in Settings.__struct_fields__:
        assert f"{key}:" in text, f"{key} undocumented"
    workers = text[text.index("\nworkers:") :]
    for key in WorkerConfig.__struct_fields__:
        assert f" {key}:" in workers, f"workers[].{key} undocumented"


def test_yaml_then_env_then_flags(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        "port: 9000\nblock_size: 32\nscoring:\n  overlap_weight: 2.0\n  temperature: 0.5\n"
        "workers:\n  - {id: a, url: 'http://127.0.0.1:1', events_endpoint: 'tcp://127.0.0.1:2'}\n"
    )
    env = {"KVROUTER_PORT": "9100", "KVROUTER_SCORING__OVERLAP_WEIGHT": "3", "OTHER": "x"}
    s = load_settings(cfg, environ=env)
    assert (s.port, s.block_size) == (9100, 32)
    assert s.scoring.overlap_weight == 3.0 and s.scoring.temperature == 0.5
    args = build_parser().parse_args(
        ["--config", str(cfg), "--port", "0", "--admin-key", "k", "--worker",
         "id=a,url=http://127.0.0.1:5,events=tcp://127.0.0.1:6,replay=tcp://127.0.0.1:7,dp=2",
         "--worker", "id=b,url=http://127.0.0.1:8,events=tcp://127.0.0.1:9,pool=p,model=m"]
    )  # fmt: skip
    s = settings_from_args(args)
    assert s.port == 0 and s.admin_key == "k" and s.block_size == 32
    a, b = s.workers
    assert (a.id, a.url, a.replay_endpoint, a.dp_ranks) == (
        "a",
        "http://127.0.0.1:5",
        "tcp://127.0.0.1:7",
        2,
    )
    assert (b.pool, b.model, b.replay_endpoint) == ("p", "m", None)


def test_env_config_path_and_string_keys(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("host: 0.0.0.0\n")
    s = load_settings(environ={"KVROUTER_CONFIG": str(cfg), "KVROUTER_ADMIN_KEY": "123"})
    assert s.host == "0.0.0.0" and s.admin_key == "123"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"bogus": 1}, "bogus: unknown key"),
        ({"scoring": {"overlap_wieght": 1}}, "scoring.overlap_wieght: unknown key"),
        ({"scoring": {"overlap_weight": -1}}, "scoring.overlap_weight: must be >= 0"),
        ({"scoring": {"tier_weights": {"DISK": 2}}}, "scoring.tier_weights.DISK"),
        ({"port": "x"}, "port: expected `int`"),
        ({"port": 70000}, "port: must be between"),
        ({"tokenizer": "gpt2"}, "tokenizer:"),
        ({"proxy": {"max_body_bytes": 1}}, "proxy.max_body_bytes"),
        ({"health": {"interval_s": 0}}, "health.interval_s"),
        ({"workers": [{"id": "a"}]}, "workers[0].url: is required"),
        ({"workers": [{"id": "a", "url": "ftp://x", "events_endpoint": "tcp://h:1"}]}, "workers[0].url"),
        ({"workers": [{"id": "a", "url": "http://x", "events_endpoint": "h:1"}]}, "workers[0].events_endpoint"),
        ({"workers": [{"id": "a", "url": "http://x", "events_endpoint": "tcp://h:1", "dp_ranks": 0}]}, "workers[0].dp_ranks"),
        (
            {"workers": [{"id": "a", "url": "http://x", "events_endpoint": "tcp://h:1"}] * 2},
            "workers[1].id",
        ),
    ],
)  # fmt: skip
def test_invalid_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        load_settings(environ={}, overrides=raw)
    assert needle in str(e.value)


def test_bad_files_and_specs(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(bad, environ={})
    bad.write_text("port: [\n")
    with pytest.raises(ConfigError, match="not YAML"):
        load_settings(bad, environ={})
    with pytest.raises(ConfigError, match="unknown item"):
        parse_worker_spec("id=a,url=http://x,events=tcp://h:1,colour=red")
    with pytest.raises(ConfigError, match="missing url="):
        parse_worker_spec("id=a,events=tcp://h:1")
    # no events=: the router reads them from the worker's GET /kv_event_sources
    assert parse_worker_spec("id=a,url=http://x") == {"id": "a", "url": "http://x"}
    with pytest.raises(ConfigError, match="dp must be an integer"):
        parse_worker_spec("id=a,url=http://x,events=tcp://h:1,dp=two")
    with pytest.raises(ConfigError, match="KVROUTER_PORT"):
        load_settings(environ={"KVROUTER_PORT": "[unclosed"})


def test_derived_tier_weights():
    s = load_settings(
        environ={},
        overrides={
            "scoring": {
                "recompute_s_per_block": 0.01,
                "tier_load_s_per_block": {"disk": 0.004, "EXTERNAL": 0.02},
            }
        },
    )
    w = s.scoring.effective_tier_weights()
    assert w["DISK"] == pytest.approx(0.6) and w["EXTERNAL"] == 0.0 and w["GPU"] == 1.0
