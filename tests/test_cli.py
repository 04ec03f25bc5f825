"""The `vlamux` command against a real server (uvicorn on localhost), through click's CliRunner."""

import json
import re

import pytest
from api_server import running_server
from click.testing import CliRunner

from vlamux.cli import main

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    with running_server(root) as (url, admin_key, host):
        yield {"url": url, "admin": admin_key, "root": root}


def run(server, *args, key=None):
    env = {"VLAMUX_URL": None, "VLAMUX_API_KEY": None, "VLAMUX_ADMIN_KEY": None}
    r = CliRunner(env=env).invoke(main, ["--url", server["url"], *(["--key", key] if key else []), *args])
    assert "Traceback" not in r.output
    return r


@pytest.fixture(scope="module")
def tenant(server):
    r = run(server, "tenants", "--admin-key", server["admin"], "create", "cli-tenant", "--max-concurrent-jobs", "3")
    assert r.exit_code == 0, r.output
    tid = re.search(r"id (\w+)", r.stdout).group(1)
    key = re.search(r"api key \(shown once\): (\S+)", r.stdout).group(1)
    return {"id": tid, "key": key}


def test_tenants_admin(server, tenant):
    r = run(server, "tenants", "list", key=server["admin"])  # --key works for the admin too
    assert r.exit_code == 0 and "cli-tenant" in r.stdout and "MAX_CONCURRENT_JOBS" in r.stdout
    assert re.search(r"cli-tenant\s+False\s+\S+ \S+\s+3\s", r.stdout), r.stdout
    r = run(server, "tenants", "quotas", tenant["id"], "--requests-per-s", "40", key=server["admin"])
    assert r.exit_code == 0 and json.loads(r.stdout)["requests_per_s"] == 40
    # A tenant's key on an admin command: one line, exit 1.
    r = run(server, "tenants", "list", key=tenant["key"])
    assert r.exit_code == 1 and r.stderr.strip() == "error: admin only [403 forbidden]"
    r = run(server, "tenants", "create", "cli-tenant", key=server["admin"])
    assert r.exit_code == 1 and "exists" in r.stderr and "[409 conflict]" in r.stderr
    # Disabled: the tenant's key stops working until enabled again.
    assert run(server, "tenants", "disable", tenant["id"], key=server["admin"]).exit_code == 0
    r = run(server, "jobs", key=tenant["key"])
    assert r.exit_code == 1 and "401 unauthenticated" in r.stderr
    assert run(server, "tenants", "enable", tenant["id"], key=server["admin"]).exit_code == 0
    assert run(server, "jobs", key=tenant["key"]).exit_code == 0


def test_keys(server, tenant):
    r = run(server, "keys", "create", "ci", key=tenant["key"])
    assert r.exit_code == 0
    key_id = re.search(r"key (\w+)", r.stdout).group(1)
    r = run(server, "keys", "list", key=tenant["key"])
    assert r.exit_code == 0 and key_id in r.stdout and "ci" in r.stdout
    assert run(server, "keys", "revoke", key_id, key=tenant["key"]).exit_code == 0
    r = run(server, "keys", "revoke", "nope", key=tenant["key"])
    assert r.exit_code == 1 and "[404 not_found]" in r.stderr


def test_policies_delete_frees_a_training_slot(server, tenant):
    from vlamux.sdk import Client

    slot = Client(server["url"], api_key=tenant["key"]).training_client(head=HEAD)
    pid = slot.id
    r = run(server, "policies", "delete", pid, key=tenant["key"])
    assert r.exit_code == 0 and r.stdout.strip() == f"training slot {pid} deleted", r.output
    r = run(server, "policies", "delete", pid, key=tenant["key"])
    assert r.exit_code == 1 and "[404 not_found]" in r.stderr


def test_errors_are_one_line(server, tenant, tmp_path):
    r = run(server, "job", "nope", key=tenant["key"])
    assert r.exit_code == 1 and r.stderr == "error: no job 'nope' [404 not_found]\n" and r.stdout == ""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nkind: sft\nhead: {kind: gaussian, action_dim: 4, horizon: 4, state_dim: 8}\n"
                   "sft: {dataset: nowhere, steps: 2}\n")
    r = run(server, "submit", str(bad), key=tenant["key"])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1
    assert "sft.dataset" in r.stderr and "422 invalid_input" in r.stderr
    r = run(server, "jobs", key="vmx_wrong")
    assert r.exit_code == 1 and "401" in r.stderr
    r = CliRunner().invoke(main, ["--url", "http://127.0.0.1:9", "--key", "k", "--timeout", "2", "--max-retries", "1",
                                  "jobs"],
                           env={"VLAMUX_API_KEY": None})
    assert r.exit_code == 1 and r.stderr.startswith("error: cannot reach the service") and "Traceback" not in r.output
    r = run(server, "submit", str(tmp_path / "missing.yaml"), key=tenant["key"])
    assert r.exit_code == 2 and "does not exist" in r.stderr  # click's own usage error


def test_demos_submit_watch_jobs_logs_usage(server, tenant, tmp_path):
    root = server["root"]
    r = CliRunner().invoke(main, ["demos", "goal/touch-red-cube", "--episodes", "2", "--image-size", "32",
                                  "--workers", "1", "--data-dir", str(root)])
    assert r.exit_code == 0, r.output
    name = r.stdout.strip().splitlines()[-1]
    assert name == "goal-touch-red-cube" and (root / "datasets" / name / "meta" / "info.json").exists()
    r = CliRunner().invoke(main, ["demos", "goal/touch-red-cube", "--episodes", "2", "--data-dir", str(root)])
    assert r.exit_code == 1 and "--overwrite" in r.stderr
    r = run(server, "datasets", key=tenant["key"])
    assert r.exit_code == 0 and name in r.stdout.split()

    spec = tmp_path / "sft.json"
    spec.write_text(json.dumps({"name": "cli-sft", "kind": "sft", "head": HEAD,
                                "sft": {"dataset": name, "steps": 4, "batch_size": 8}, "checkpoint_every": 2}))
    r = run(server, "submit", str(spec), key=tenant["key"])  # watches by default
    assert r.exit_code == 0, r.output
    job_id = re.search(r"submitted job (\w+)", r.stdout).group(1)
    assert f"job {job_id} succeeded" in r.stdout and "cli-sft sft" in r.stderr  # the progress bar
    r = run(server, "jobs", "--state", "succeeded", key=tenant["key"])
    assert r.exit_code == 0 and r.stdout.splitlines()[0].split() == ["ID", "NAME", "KIND", "STATE", "QUEUE", "CREATED"]
    assert re.search(rf"{job_id}\s+cli-sft\s+sft\s+succeeded", r.stdout)
    r = run(server, "job", job_id, key=tenant["key"])
    assert r.exit_code == 0 and json.loads(r.stdout)["progress"]["step"] == 4
    r = run(server, "logs", job_id, "--follow", key=tenant["key"])
    assert r.exit_code == 0 and "state succeeded" in r.stdout and "loss" in r.stdout
    r = run(server, "cancel", job_id, key=tenant["key"])
    assert r.exit_code == 1 and "already succeeded" in r.stderr and "[409 conflict]" in r.stderr
    r = run(server, "policies", key=tenant["key"])
    assert r.exit_code == 0 and job_id in r.stdout

    long = tmp_path / "long.yaml"
    long.write_text(f"name: long\nkind: sft\nhead: {json.dumps(HEAD)}\n"
                    f"sft: {{dataset: {name}, steps: 100000, batch_size: 8}}\ncheckpoint_every: 100000\n")
    r = run(server, "submit", str(long), "--no-watch", key=tenant["key"])
    assert r.exit_code == 0 and r.stderr == "", r.output
    second = re.search(r"submitted job (\w+)", r.stdout).group(1)
    r = run(server, "cancel", second, key=tenant["key"])
    assert r.exit_code == 0 and r.stdout.strip() == f"job {second} cancelled"

    r = run(server, "usage", key=tenant["key"])
    assert r.exit_code == 0 and tenant["id"] in r.stdout and "STORED_BYTES" in r.stdout
    r = run(server, "usage", "--tenant", tenant["id"], key=server["admin"])
    assert r.exit_code == 0 and tenant["id"] in r.stdout


def test_serve_runs_until_interrupted(tmp_path):
    """`vlamux serve` as a real process: answers, takes the given admin key, stops on SIGINT."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import vlamux

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    admin = "vmx_test_admin_secret"
    proc = subprocess.Popen([sys.executable, "-m", "vlamux.cli", "serve", "--port", str(port), "--data-dir",
                             str(tmp_path / "svc"), "--admin-key", admin, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with vlamux.Client(f"http://127.0.0.1:{port}", api_key=admin, max_retries=0) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert c.health()["ok"]
                    break
                except vlamux.sdk.ServiceUnavailableError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                    time.sleep(0.2)
            assert c.admin.list_tenants() == []
        r = run({"url": f"http://127.0.0.1:{port}"}, "jobs")
        assert r.exit_code == 1 and "no API key" in r.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"vlamux serving on http://127.0.0.1:{port} (embedded runtime" in out


def test_bench_lists_scripts():
    r = CliRunner().invoke(main, ["bench"])
    assert r.exit_code == 0 and "multi_tenant" in r.stdout
    r = CliRunner().invoke(main, ["bench", "no_such_bench"])
    assert r.exit_code == 2 and "no benchmark 'no_such_bench'" in r.stderr and "async_rl" in r.stderr
