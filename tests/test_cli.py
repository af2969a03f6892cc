"""The ``keepalive`` command: ``--version``, ``--help`` of every sub-command, ``ls --json`` and
``verify`` on good and damaged runs (as a real subprocess and through ``keepalive.cli.main``), on a
local folder, memory://, gs:// and s3://."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from keepalive import __version__, cli
from keepalive.store import CheckpointStore
from test_store_backends import (
    drop_manifest,
    files_for,
    flip_byte,
    manifest_names_missing_file,
    tear_manifest,
    truncate,
)

BIN = os.path.dirname(sys.executable)
LS_KEYS = {"path", "run", "step", "epoch", "created", "size_bytes", "valid"}


def run_cli(*args, cwd=None, env=None):
    """``python -m keepalive ARGS`` as a real process."""
    return subprocess.run([sys.executable, "-m", "keepalive", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def subcommands():
    parser = cli.build_parser()
    for action in parser._subparsers._group_actions:
        return sorted(action.choices)
    return []


def make_run(store, steps):
    infos = [store.commit(files_for(s), step=s, epoch=s // 2).info for s in steps]
    store.close()
    return infos


@pytest.fixture
def cli_env(location, monkeypatch):
    """``keepalive`` takes URLs but no storage options: point s3fs at moto through the environment
    (gcsfs already follows STORAGE_EMULATOR_HOST, set in conftest)."""
    if location.kind == "s3":
        endpoint = location.storage_options["client_kwargs"]["endpoint_url"]
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        # fsspec keeps one S3FileSystem per set of options: one made earlier in this process without
        # credentials (another test's) would be handed to the CLI with its credential-less client
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    return location


# ------------------------------------------------------------------------------- version, help
def test_version_and_help_subprocess():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"keepalive {__version__}"
    r = run_cli("--help")
    assert r.returncode == 0
    for name in ("ls", "verify", "status"):
        assert name in r.stdout
    r = run_cli()
    assert r.returncode == 0 and "usage: keepalive" in r.stdout
    script = os.path.join(BIN, "keepalive")
    assert os.path.exists(script), "console script not installed"
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and __version__ in r.stdout


def test_every_subcommand_has_help(capsys):
    names = subcommands()
    assert {"ls", "verify", "status"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        assert exc.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: keepalive {name}"), (name, out)


@pytest.mark.parametrize("name", ["ls", "verify", "status"])
def test_subcommand_help_subprocess(name):
    r = run_cli(name, "--help")
    assert r.returncode == 0 and f"usage: keepalive {name}" in r.stdout and "--json" in r.stdout


def test_unknown_subcommand_fails():
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ------------------------------------------------------------------------------------ ls --json
def test_ls_json_subprocess(tmp_path):
    store = CheckpointStore(tmp_path / "runs" / "pets", keep=None)
    infos = make_run(store, [0, 3, 7])
    (tmp_path / "runs" / "pets" / "ckpt-0000000009-unfinish").mkdir()  # a crashed write
    r = run_cli("ls", tmp_path / "runs" / "pets", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert LS_KEYS <= row.keys()
        assert row["run"] == "pets"
    good = rows[:3]
    assert [row["step"] for row in good] == [0, 3, 7]
    assert [row["epoch"] for row in good] == [0, 1, 3]
    assert [row["path"] for row in good] == [i.path for i in infos]
    assert all(row["valid"] is True and os.path.isdir(row["path"]) for row in good)
    assert all(row["size_bytes"] == i.size_bytes and row["size_bytes"] > 3000 for row, i in zip(good, infos))
    assert all(row["created"].endswith("Z") and row["created"][:2] == "20" for row in good)
    assert rows[3]["valid"] is False and rows[3]["step"] == 9 and rows[3]["path"].endswith("unfinish")

    # a folder of runs lists every run; a checkpoint folder lists itself
    CheckpointStore(tmp_path / "runs" / "mnist").commit(files_for(1), step=1)
    r = run_cli("ls", tmp_path / "runs", "--json")
    runs = [json.loads(line)["run"] for line in r.stdout.splitlines()]
    assert r.returncode == 0 and sorted(set(runs)) == ["mnist", "pets"] and len(runs) == 5
    r = run_cli("ls", infos[1].path, "--json")
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["step"] == 3 and row["path"] == infos[1].path

    # the table
    r = run_cli("ls", tmp_path / "runs")
    assert r.returncode == 0 and "pets" in r.stdout and "mnist" in r.stdout and "INVALID" in r.stdout


def test_ls_verify_flags_damage(cli_env, capsys):
    store = cli_env.store("run", keep=None)
    infos = make_run(store, [1, 2])
    flip_byte(store, infos[1])
    assert cli.main(["ls", cli_env.join("run"), "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["valid"] for r in rows] == [True, True]  # without --verify: manifests only
    assert cli.main(["ls", cli_env.join("run"), "--json", "--verify"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["valid"] for r in rows] == [True, False]
    assert "checksum" in rows[1]["error"]
    assert all(LS_KEYS <= r.keys() for r in rows)
    assert rows[0]["path"].startswith(cli_env.kind + "://") or cli_env.kind == "local"


# ------------------------------------------------------------------------------------- verify
def damaged_run(store):
    infos = make_run(store, [1, 2, 3, 4, 5, 6])
    damage = {infos[1].name: flip_byte, infos[2].name: truncate, infos[3].name: drop_manifest,
              infos[4].name: tear_manifest, infos[5].name: manifest_names_missing_file}
    for info in infos[1:]:
        damage[info.name](store, info)
    return infos[0].name, sorted(damage)


def test_verify_subprocess(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=None)
    make_run(store, [1, 2])
    r = run_cli("verify", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert "all 2 checkpoint(s) verified" in r.stdout

    good, bad = damaged_run(CheckpointStore(tmp_path / "damaged", keep=None))
    r = run_cli("verify", tmp_path / "damaged")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert f"OK  damaged/{good}" in lines
    for name in bad:
        assert any(line.startswith(f"BAD damaged/{name}: ") for line in lines), (name, r.stdout)
        assert name in r.stderr
    assert "5 of 6 checkpoint(s) failed" in r.stderr
    reasons = "\n".join(lines)
    for why in ("checksum", "truncated", "no manifest", "not valid JSON", "extra.bin is missing"):
        assert why in reasons

    # a folder of runs: the bad ones of every run are named
    r = run_cli("verify", tmp_path)
    assert r.returncode == 1 and all(name in r.stderr for name in bad)

    # one checkpoint folder, also as a bare name relative to the run
    r = run_cli("verify", tmp_path / "damaged" / good)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("verify", bad[0], cwd=tmp_path / "damaged")
    assert r.returncode == 1 and bad[0] in r.stderr
    r = run_cli("verify", good, cwd=tmp_path / "damaged")
    assert r.returncode == 0, r.stdout + r.stderr

    # --json
    r = run_cli("verify", tmp_path / "damaged", "--json")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 1 and len(rows) == 6
    assert sorted(row["name"] for row in rows if not row["valid"]) == bad


def test_verify_all_backends(cli_env, capsys):
    store = cli_env.store("run", keep=None)
    good, bad = damaged_run(store)
    assert cli.main(["verify", cli_env.join("run")]) == 1
    out, err = capsys.readouterr()
    assert f"OK  run/{good}" in out
    for name in bad:
        assert f"BAD run/{name}" in out and name in err
    assert cli.main(["verify", cli_env.join("run", good)]) == 0
    assert cli.main(["verify", cli_env.join("run", bad[0])]) == 1


def test_verify_and_ls_foreign_or_missing(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    r = run_cli("verify", tmp_path / "photos")
    assert r.returncode == 2 and "no keepalive run or checkpoint" in r.stderr
    r = run_cli("ls", tmp_path / "photos", "--json")
    assert r.returncode == 1 and "no keepalive run or checkpoint" in r.stderr and r.stdout == ""
    r = run_cli("verify", tmp_path / "nowhere")
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr

    # an empty run (lease only, nothing committed yet)
    store = CheckpointStore(tmp_path / "empty")
    store.open_for_writing()
    store.close()
    r = run_cli("verify", tmp_path / "empty")
    assert r.returncode == 2 and "no checkpoints" in r.stderr
    r = run_cli("ls", tmp_path / "empty")
    assert r.returncode == 0 and "no checkpoints" in r.stdout


# ------------------------------------------------- bad input, credentials, no network
def _no_cloud_credentials(**extra):
    """The environment of a machine with no cloud credentials at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_CONFIG_FILE=os.devnull)
    env.update(extra)
    return env


def _one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("keepalive ")
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


def test_s3_without_credentials_is_one_line_and_storage_options_give_them(s3_server):
    store = CheckpointStore(s3_server.url("creds", "run"), keep=None, storage_options=s3_server.storage_options)
    make_run(store, [1, 2])
    url = s3_server.url("creds", "run")
    endpoint_only = json.dumps({"client_kwargs": {"endpoint_url": s3_server.endpoint}})
    env = _no_cloud_credentials()
    for command in ("ls", "verify", "sync"):
        r = run_cli(command, url, "--storage-options", endpoint_only, env=env)
        _one_line_error(r, f"keepalive {command}: no AWS credentials for {url}", "--storage-options")
        assert r.returncode == 1
    full = json.dumps(s3_server.storage_options)
    r = run_cli("ls", url, "--json", "--storage-options", full, env=env)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["step"] for line in r.stdout.splitlines()] == [1, 2]
    r = run_cli("verify", url, "--storage-options", full, env=env)
    assert r.returncode == 0 and "all 2 checkpoint(s) verified" in r.stdout, r.stderr
    r = run_cli("sync", url, "--storage-options", full, env=env)
    assert r.returncode == 0 and "nothing to upload" in r.stdout, r.stderr


def test_gcs_storage_options_reach_the_emulator(gcs_server):
    store = CheckpointStore(gcs_server.url("opts", "run"), keep=None, storage_options=gcs_server.storage_options)
    make_run(store, [3])
    r = run_cli("ls", gcs_server.url("opts", "run"), "--json", "--storage-options",
                json.dumps(gcs_server.storage_options))
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["step"] for line in r.stdout.splitlines()] == [3]


@pytest.mark.parametrize("kind", ["gs", "s3"])
def test_an_unreachable_store_answers_in_bounded_time(kind):
    """A store that does not answer (here: a closed local port) gets one line within the connect
    timeout, not the storage library's minute of retries and its tracebacks."""
    from servers import free_port

    port = free_port()   # nothing listens on it
    if kind == "gs":
        env = _no_cloud_credentials(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}")
        args = ["ls", "gs://bucket/run"]
    else:
        env = _no_cloud_credentials()
        args = ["ls", "s3://bucket/run", "--storage-options", json.dumps(
            {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}})]
    t0 = time.monotonic()
    r = run_cli(*args, "--connect-timeout", "3", env=env)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed
    _one_line_error(r)
    assert r.returncode == 1
    assert ("no answer from" in r.stderr and "within 3 s" in r.stderr) or "cannot reach the store" in r.stderr


@pytest.mark.parametrize("args, exit_code, needle", [
    (["ls", "s3://b/x", "--storage-options", "{not json"], 2, "--storage-options is not valid JSON"),
    (["verify", "s3://b/x", "--storage-options", "[1, 2]"], 2, "must be a JSON object"),
    (["sync", "s3://b/x", "--storage-options", "7"], 2, "must be a JSON object"),
    (["ls", "nope://bucket/run"], 1, "Protocol not known: nope"),
    (["verify", "nope://bucket/run"], 1, "not a storage protocol"),
    (["ls", "s3://b/x", "--storage-options", '{"no_such_option": 1}'], 1, "storage option is not accepted"),
])
def test_bad_input_is_one_line(args, exit_code, needle):
    r = run_cli(*args, env=_no_cloud_credentials())
    _one_line_error(r, needle)
    assert r.returncode == exit_code


def test_a_closed_pipe_is_quiet(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=None)
    make_run(store, list(range(1, 7)))
    for args in (["ls", tmp_path / "run"], ["ls", tmp_path / "run", "--json"], ["verify", tmp_path / "run"],
                 ["status", "--settings"]):
        proc = subprocess.Popen([sys.executable, "-m", "keepalive", *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()            # the reader is gone before the first line is written
        err = proc.stderr.read().decode()
        assert proc.wait(60) == 141, err
        assert err == "", err
    # and as people write it
    r = subprocess.run(f"{sys.executable} -m keepalive ls --json {tmp_path / 'run'} | head -1",
                       shell=True, capture_output=True, text=True, timeout=60)
    assert r.stderr == "" and json.loads(r.stdout)["step"] == 1


def test_in_process_errors_are_one_line_too(capsys):
    assert cli.main(["ls", "nope://x/y"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Protocol not known" in err
    assert cli.main(["ls", "x", "--storage-options", "{"]) == 2


def test_ls_without_path_lists_the_default_dir_and_the_runs_recorded_elsewhere(tmp_path):
    from keepalive.runs import record_run

    default = tmp_path / "default"
    make_run(CheckpointStore(default / "here", keep=None), [1])
    make_run(CheckpointStore(tmp_path / "drive" / "away", keep=None), [4, 5])
    assert record_run(str(tmp_path / "drive" / "away"), str(default))
    env = dict(os.environ, KEEPALIVE_DIR=str(default), KEEPALIVE_SPOOL=str(tmp_path / "spool"))
    r = run_cli("ls", "--json", env=env)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["run"], row["step"]) for row in rows] == [("here", 1), ("away", 4), ("away", 5)]
    r = run_cli("ls", env=env)
    assert r.returncode == 0 and "here" in r.stdout and "away" in r.stdout
    r = run_cli("ls", env=dict(env, KEEPALIVE_DIR=str(tmp_path / "empty")))
    assert r.returncode == 0 and "no checkpoints under the default checkpoint dir" in r.stdout
