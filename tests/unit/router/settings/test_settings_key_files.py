"""``admin_key_file`` and ``api_keys_file`` (issue 21): read at start into ``admin_key`` and
``api_keys``, from the config file, the environment or the flags; mutually exclusive with the
keys they replace; a missing, unreadable or empty file stops the start naming the key and the
path, never the content."""

from __future__ import annotations

import os

import pytest

from router.cli import build_parser, settings_from_args
from router.errors import ConfigError
from router.settings import load_settings

SECRET = "s3cr3t-admin-key-0123456789"


def test_admin_key_file_content_stripped_from_config_env_or_flag(tmp_path):
    f = tmp_path / "admin-key"
    f.write_text(f"  {SECRET}\n\n")
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"admin_key_file: {f}\n")
    s = load_settings(cfg, environ={})
    assert s.admin_key == SECRET and s.admin_key_file == str(f)
    assert load_settings(environ={"KVROUTER_ADMIN_KEY_FILE": str(f)}).admin_key == SECRET
    args = build_parser().parse_args(["--admin-key-file", str(f)])
    assert settings_from_args(args).admin_key == SECRET


def test_a_path_that_yaml_would_read_as_a_number_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "0123").write_text(SECRET)
    s = load_settings(environ={"KVROUTER_ADMIN_KEY_FILE": "0123"})
    assert s.admin_key == SECRET and s.admin_key_file == "0123"


def test_api_keys_file_one_a_line_without_blanks_or_comments(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# client keys\nk1\n\n  k2  \n   # retired: old\nk3")
    s = load_settings(environ={}, overrides={"api_keys_file": str(f)})
    assert s.api_keys == ["k1", "k2", "k3"]
    args = build_parser().parse_args(["--api-keys-file", str(f)])
    assert settings_from_args(args).api_keys == ["k1", "k2", "k3"]
    assert load_settings(environ={"KVROUTER_API_KEYS_FILE": str(f)}).api_keys[0] == "k1"


@pytest.mark.parametrize(
    ("raw", "env", "needle"),
    [
        ({"admin_key": "k", "admin_key_file": "F"}, {}, "admin_key and admin_key_file"),
        ({"admin_key_file": "F"}, {"KVROUTER_ADMIN_KEY": "k"}, "admin_key and admin_key_file"),
        ({"admin_key": "k"}, {"KVROUTER_ADMIN_KEY_FILE": "F"}, "admin_key and admin_key_file"),
        ({"api_keys": ["a"], "api_keys_file": "F"}, {}, "api_keys and api_keys_file"),
        ({"api_keys_file": "F"}, {"KVROUTER_API_KEYS": "[a]"}, "api_keys and api_keys_file"),
    ],
)
def test_a_key_and_its_file_are_mutually_exclusive(tmp_path, raw, env, needle):
    f = tmp_path / "F"
    f.write_text(SECRET)
    raw = {k: str(f) if v == "F" else v for k, v in raw.items()}
    env = {k: str(f) if v == "F" else v for k, v in env.items()}
    with pytest.raises(ConfigError, match=needle):
        load_settings(environ=env, overrides=raw)


@pytest.mark.parametrize("key", ["admin_key_file", "api_keys_file"])
def test_missing_unreadable_or_empty_files_fail_naming_key_and_path_not_content(tmp_path, key):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"{key}: cannot read {missing}: No such file"):
        load_settings(environ={}, overrides={key: str(missing)})
    with pytest.raises(ConfigError, match=f"{key}: cannot read {tmp_path}: Is a directory"):
        load_settings(environ={}, overrides={key: str(tmp_path)})
    empty = tmp_path / "empty"
    empty.write_text("\n  \n" + ("# only a comment\n" if key == "api_keys_file" else ""))
    with pytest.raises(ConfigError, match=f"{key}: {empty} (is empty|holds no key)"):
        load_settings(environ={}, overrides={key: str(empty)})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" + SECRET.encode())
    with pytest.raises(ConfigError, match=f"{key}: {binary} is not UTF-8") as e:
        load_settings(environ={}, overrides={key: str(binary)})
    assert SECRET not in str(e.value) and e.value.__cause__ is None
    with pytest.raises(ConfigError, match=f"{key}: expected the path of a file"):
        load_settings(environ={}, overrides={key: 5})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_file_the_router_may_not_read(tmp_path):
    f = tmp_path / "admin-key"
    f.write_text(SECRET)
    f.chmod(0)
    with pytest.raises(ConfigError, match=r"admin_key_file: cannot read .*Permission denied") as e:
        load_settings(environ={}, overrides={"admin_key_file": str(f)})
    assert SECRET not in str(e.value)


def test_an_admin_key_file_of_several_lines_is_refused_without_showing_them(tmp_path):
    f = tmp_path / "admin-key"
    f.write_text(f"{SECRET}\nsecond-line\n")
    with pytest.raises(ConfigError, match=f"admin_key_file: {f} holds 2 lines") as e:
        load_settings(environ={}, overrides={"admin_key_file": str(f)})
    assert SECRET not in str(e.value) and "second-line" not in str(e.value)
