"""keepalive.settings: every KEEPALIVE_* variable parsed in one place; a bad value is shown once and
the default used; `keepalive status --settings [--json]` lists them all."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from keepalive import settings, status

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEPALIVE_")}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "keepalive", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


# ------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("name, raw, value", [
    ("KEEPALIVE_SPOOL_SLOW", "30s", 30.0),
    ("KEEPALIVE_SPOOL_SLOW", "2min", 120.0),
    ("KEEPALIVE_FLUSH_TIMEOUT", "5", 5.0),
    ("KEEPALIVE_DRIVE_FLUSH", "yes", True),
    ("KEEPALIVE_DRIVE_FLUSH", "0", False),
    ("KEEPALIVE_PROGRESS", "auto", None),
    ("KEEPALIVE_PROGRESS", "on", True),
    ("KEEPALIVE_PROGRESS", "never", False),
    ("KEEPALIVE_PROGRESS_MIN_BYTES", "1000", 1000),
    ("KEEPALIVE_PROGRESS_MIN_BYTES", "1GiB", 1 << 30),
    ("KEEPALIVE_SPOOL_MAX", "10GB", 10 * 10 ** 9),
    ("KEEPALIVE_SPOOL_MODE", "ON", "always"),
    ("KEEPALIVE_VERBOSITY", " Debug ", "debug"),
    ("KEEPALIVE_PLATFORM", " Kaggle", "kaggle"),
    ("KEEPALIVE_BUDGET", " 3h ", "3h"),
    ("KEEPALIVE_BUDGET", "", None),
    ("KEEPALIVE_BENCH_THREADS", "4", 4),
    ("KEEPALIVE_BENCH_THREADS", "0", None),
])
def test_values_parse(name, raw, value):
    assert settings.get(name, env={name: raw}) == value


def test_defaults_and_unknown_names():
    for name, setting in settings.SETTINGS.items():
        assert name.startswith("KEEPALIVE_") and setting.doc
        assert settings.get(name, env={}) == setting.default
    with pytest.raises(KeyError):
        settings.get("KEEPALIVE_NO_SUCH_THING", env={})
    assert settings.is_set("KEEPALIVE_DIR", env={"KEEPALIVE_DIR": "/x"})
    assert not settings.is_set("KEEPALIVE_DIR", env={"KEEPALIVE_DIR": "  "})


def test_home_is_expanded_in_paths():
    assert settings.get("KEEPALIVE_DIR", env={"KEEPALIVE_DIR": "~/ckpt"}) == os.path.expanduser("~/ckpt")


@pytest.mark.parametrize("name, bad", [
    ("KEEPALIVE_SPOOL_SLOW", "soonish"),
    ("KEEPALIVE_DRIVE_FLUSH", "maybe"),
    ("KEEPALIVE_VERBOSITY", "loud"),
    ("KEEPALIVE_PROGRESS_MIN_BYTES", "big"),
    ("KEEPALIVE_SPOOL_MODE", "sometimes"),
])
def test_bad_value_warns_once_visibly_and_uses_the_default(name, bad, capsys):
    bad = f"{bad}-{uuid.uuid4().hex[:6]}"          # a value no earlier test has reported
    default = settings.SETTINGS[name].default
    assert settings.get(name, env={name: bad}) == default
    err = capsys.readouterr().err
    assert err.count("keepalive: warning:") == 1
    assert name in err and bad in err and "default" in err
    # read again (cached), and in another environment that holds the same bad value (re-parsed):
    assert settings.get(name, env={name: bad}) == default
    assert settings.get(name, env={name: bad, "KEEPALIVE_DIR": "/elsewhere"}) == default
    assert capsys.readouterr().err == ""             # shown once, not at every read


def test_environment_changes_are_seen():
    env = {"KEEPALIVE_SPOOL_SLOW": "3s"}
    assert settings.get("KEEPALIVE_SPOOL_SLOW", env=env) == 3.0
    env["KEEPALIVE_SPOOL_SLOW"] = "4s"                # e.g. %env between two cells
    assert settings.get("KEEPALIVE_SPOOL_SLOW", env=env) == 4.0


# ---------------------------------------------------------------------- keepalive status --settings
def test_table_rows():
    rows = settings.table(env={"KEEPALIVE_SPOOL_SLOW": "30s"})
    assert [r["name"] for r in rows] == list(settings.SETTINGS)
    row = {r["name"]: r for r in rows}
    assert row["KEEPALIVE_SPOOL_SLOW"]["value"] == 30.0 and row["KEEPALIVE_SPOOL_SLOW"]["set"] is True
    assert row["KEEPALIVE_SPOOL_SLOW"]["default"] == 10.0
    assert row["KEEPALIVE_FLUSH_TIMEOUT"]["set"] is False
    text = status.format_settings(rows)
    for name in settings.SETTINGS:
        assert name in text
    assert text.count("[set;") == 1


def test_status_settings_text_and_json():
    env = clean_env(KEEPALIVE_SPOOL_SLOW="30s", KEEPALIVE_VERBOSITY="loud")
    proc = run_cli(env, "status", "--settings")
    out = proc.stdout
    for name in settings.SETTINGS:
        assert name in out
    slow = next(line for line in out.splitlines() if "KEEPALIVE_SPOOL_SLOW" in line)
    assert "30.0" in slow and "[set;" in slow
    verbosity = next(line for line in out.splitlines() if "KEEPALIVE_VERBOSITY" in line)
    assert "'normal'" in verbosity and "[set;" in verbosity       # bad value: the default in force
    assert proc.stderr.count("keepalive: warning: ignoring KEEPALIVE_VERBOSITY='loud'") == 1  # once
    assert "keepalive status: platform" not in out                  # the table, not the panel

    rows = json.loads(run_cli(clean_env(KEEPALIVE_SPOOL_SLOW="30s"), "status", "--settings", "--json").stdout)
    row = {r["name"]: r for r in rows}
    assert set(row) == set(settings.SETTINGS)
    assert set(row["KEEPALIVE_SPOOL_SLOW"]) == {"name", "value", "default", "set", "kind", "doc"}
    assert row["KEEPALIVE_SPOOL_SLOW"]["value"] == 30.0 and row["KEEPALIVE_SPOOL_SLOW"]["set"] is True
    assert row["KEEPALIVE_FLUSH_TIMEOUT"] == {**row["KEEPALIVE_FLUSH_TIMEOUT"], "value": 120.0, "set": False}


def test_status_help_mentions_settings():
    assert "--settings" in run_cli(clean_env(), "status", "--help").stdout
