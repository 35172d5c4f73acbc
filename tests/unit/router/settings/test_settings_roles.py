"""Worker roles and the ``pd:`` section in the settings: ``role:`` / ``bootstrap_port:`` in the
YAML ``workers:`` list, ``role=`` / ``bootstrap=`` in a ``--worker`` item and in the environment,
and errors that name the key."""

from __future__ import annotations

import pytest

from router.cli import build_parser, settings_from_args
from router.errors import ConfigError
from router.settings import load_settings
from router.settings.pd import PdSettings

W = {"id": "a", "url": "http://x", "events_endpoint": "tcp://h:1"}


def test_role_defaults_to_both_and_no_bootstrap_port():
    (w,) = load_settings(environ={}, overrides={"workers": [W]}).workers
    assert (w.role, w.bootstrap_port) == ("both", None)
    assert load_settings(environ={}).pd == PdSettings()


def test_roles_from_yaml_flags_and_environment(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        "workers:\n"
        "  - {id: p0, url: 'http://p:8000', role: prefill, bootstrap_port: 8998}\n"
        "  - {id: d0, url: 'http://d:8000', role: decode}\n"
        "pd: {mode: cost, protocol: sglang, min_remote_tokens: 128}\n"
    )
    args = build_parser().parse_args(
        ["--config", str(cfg), "--worker", "id=d1,url=http://d1:8000,role=decode",
         "--worker", "id=p0,url=http://p:9000,role=prefill,bootstrap=9001"]
    )  # fmt: skip
    s = settings_from_args(args)
    got = {w.id: (w.url, w.role, w.bootstrap_port) for w in s.workers}
    assert got == {
        "p0": ("http://p:9000", "prefill", 9001),  # the flag replaced the file's entry
        "d0": ("http://d:8000", "decode", None),
        "d1": ("http://d1:8000", "decode", None),
    }
    assert (s.pd.mode, s.pd.protocol, s.pd.min_remote_tokens) == ("cost", "sglang", 128)
    env = load_settings(
        environ={"KVROUTER_PD__MODE": "always", "KVROUTER_PD__PREFILL_TIMEOUT_S": "10"}
    )
    assert (env.pd.mode, env.pd.prefill_timeout_s) == ("always", 10.0)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"workers": [{**W, "role": "encoder"}]}, "workers[0].role: must be one of prefill, decode, both"),
        ({"workers": [{**W, "bootstrap_port": 0}]}, "workers[0].bootstrap_port: must be between 1 and 65535"),
        ({"workers": [{**W, "bootstrap_port": "x"}]}, "workers[0].bootstrap_port"),
        ({"pd": {"mode": "sometimes"}}, "pd.mode: must be one of"),
        ({"pd": {"protocol": "mooncake"}}, "pd.protocol: must be one of"),
        ({"pd": {"min_remote_ratio": 1.5}}, "pd.min_remote_ratio"),
        ({"pd": {"prefill_timeout_s": 0}}, "pd.prefill_timeout_s"),
        ({"pd": {"prefill_retries": 5}}, "pd.prefill_retries"),
        ({"pd": {"colour": "red"}}, "pd.colour"),
    ],
)  # fmt: skip
def test_bad_roles_and_pd_keys_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        load_settings(environ={}, overrides=raw)
    assert needle in str(e.value)


def test_worker_spec_bootstrap_must_be_an_integer():
    with pytest.raises(ConfigError, match="bootstrap must be an integer"):
        load_settings(environ={}, worker_specs=["id=a,url=http://x,bootstrap=eight"])
    with pytest.raises(ConfigError, match="role"):
        load_settings(environ={}, worker_specs=["id=a,url=http://x,role=prefil"])
