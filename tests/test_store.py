"""The service store on a real SQLite file and on a real PostgreSQL server (tests/postgres.py): secrets,
tenant isolation, durability, concurrency. Each test runs on both, unless it is about one of them."""

import sqlite3
import threading
import uuid

import pytest

from vlamux.store import Store
from vlamux.store import store as store_mod

SHA = "ab" * 32


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """open_store(name="svc") opens (again) the store `name` of this test: a SQLite file in tmp_path,
    or a database of its own on the session's PostgreSQL server."""
    urls: dict[str, str] = {}

    def make(name: str = "svc") -> Store:
        if request.param == "sqlite":
            return Store(data_dir=tmp_path / name)
        if name not in urls:
            from postgres import fresh_database

            urls[name] = fresh_database(request.getfixturevalue("postgres_url"), f"t_{uuid.uuid4().hex[:12]}")
        return Store(urls[name])

    make.kind = request.param
    return make


@pytest.fixture
def store(open_store):
    s = open_store()
    yield s
    s.close()


def raw_dump(s: Store) -> str:
    """Every cell of every table, as text, read with the database's own driver (not SQLAlchemy)."""
    if s.url.startswith("sqlite"):
        con = sqlite3.connect(s.url.removeprefix("sqlite:///"))
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            return "\n".join(repr(row) for t in tables for row in con.execute(f"SELECT * FROM {t}"))
        finally:
            con.close()
    import psycopg

    with psycopg.connect(s.url.replace("postgresql+psycopg://", "postgresql://")) as con:
        tables = [r[0] for r in con.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return "\n".join(repr(row) for t in tables for row in con.execute(f'SELECT * FROM "{t}"'))


def test_default_url_creates_sqlite_file_in_wal_mode(tmp_path):
    s = Store(data_dir=tmp_path / "a" / "b")
    s.create_tenant("acme")
    db = tmp_path / "a" / "b" / "vlamux.db"
    assert db.is_file()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    s.close()


def test_key_secret_authenticates_and_only_its_hash_is_stored(store):
    t = store.create_tenant("acme")
    key, secret = store.create_key(t.id, "ci")
    assert secret.startswith(f"vmx_{key.id}_") and len(secret) > 40
    got = store.authenticate(secret)
    assert got is not None and got.id == key.id and got.tenant_id == t.id and not got.is_admin
    assert got.last_used_at is not None
    assert store.authenticate(secret + "x") is None
    assert store.authenticate("") is None
    dump = raw_dump(store)
    assert secret not in dump
    assert secret.split("_", 2)[2] not in dump  # not even the random part
    assert store_mod.secret_digest(secret) in dump


def test_revoked_key_and_disabled_tenant_do_not_authenticate(store):
    t = store.create_tenant("acme")
    k1, s1 = store.create_key(t.id)
    k2, s2 = store.create_key(t.id)
    assert store.revoke_key(k1.id, t.id) is True
    assert store.authenticate(s1) is None
    assert store.authenticate(s2) is not None
    store.set_disabled(t.id, True)
    assert store.authenticate(s2) is None
    store.set_disabled(t.id, False)
    assert store.authenticate(s2) is not None
    assert [k.revoked_at is not None for k in store.list_keys(t.id)] == [True, False]


def test_last_used_written_at_most_once_a_minute(store, monkeypatch):
    t = store.create_tenant("acme")
    _, secret = store.create_key(t.id)
    clock = [1000.0]
    monkeypatch.setattr(store_mod.time, "time", lambda: clock[0])
    assert store.authenticate(secret).last_used_at == 1000.0
    clock[0] = 1030.0
    assert store.authenticate(secret).last_used_at == 1000.0
    clock[0] = 1061.0
    assert store.authenticate(secret).last_used_at == 1061.0
    assert store.list_keys(t.id)[0].last_used_at == 1061.0


def test_tenants_cannot_reach_each_others_rows(store):
    a, b = store.create_tenant("alpha"), store.create_tenant("beta")
    ka, sa = store.create_key(a.id)
    kb, _ = store.create_key(b.id)
    ja = store.create_job(a.id, "j", "sft", {"steps": 3}, "/w/a")
    jb = store.create_job(b.id, "j", "rl", {}, "/w/b")
    ca = store.add_checkpoint(a.id, "pol", 1, "/c/a", 10, SHA, job_id=ja.id)
    store.add_checkpoint(b.id, "pol", 1, "/c/b", 10, SHA)

    assert store.get_job(ja.id, tenant_id=b.id) is None
    assert store.get_job(ja.id, tenant_id=a.id).id == ja.id
    assert store.get_checkpoint(ca.id, b.id) is None
    assert store.get_checkpoint(ca.id, a.id) == ca
    # B revoking A's key looks exactly like revoking a missing key, and changes nothing.
    assert store.revoke_key(ka.id, b.id) is False
    assert store.revoke_key("nonexistent", b.id) is False
    assert store.revoke_key(ka.id, None) is False  # an admin-key revoke does not reach tenant keys
    assert store.authenticate(sa) is not None

    assert [j.id for j in store.list_jobs(b.id)] == [jb.id]
    assert [k.id for k in store.list_keys(b.id)] == [kb.id]
    assert [c.tenant_id for c in store.list_checkpoints(b.id)] == [b.id]
    assert store.list_checkpoints(b.id, job_id=ja.id) == []
    assert store.count_jobs(b.id, ["queued"]) == 1
    assert {j.id for j in store.list_jobs()} == {ja.id, jb.id}
    with pytest.raises(KeyError, match="no job"):  # a checkpoint cannot cite another tenant's job
        store.add_checkpoint(b.id, "pol", 2, "/c/b2", 1, SHA, job_id=ja.id)


def test_job_transitions_log_events_in_order(store):
    t = store.create_tenant("acme")
    j = store.create_job(t.id, "ft", "sft", {"lr": 1e-3}, "/w")
    assert j.state == "queued" and j.spec == {"lr": 1e-3}
    store.set_job_state(j.id, "running", detail="picked up")
    store.set_job_progress(j.id, {"step": 5, "loss": 0.5})
    store.set_job_state(j.id, "failed", error="boom")
    store.set_job_state(j.id, "queued", detail="retry")
    done = store.set_job_state(j.id, "succeeded", result={"final_loss": 0.1})
    events = store.job_events(j.id)
    assert [e.state for e in events] == ["queued", "running", "failed", "queued", "succeeded"]
    assert [e.detail for e in events][1:3] == ["picked up", "boom"]
    assert all(e1.at <= e2.at and e1.id < e2.id for e1, e2 in zip(events, events[1:]))
    assert done.error is None and done.result == {"final_loss": 0.1}
    assert done.progress == {"step": 5, "loss": 0.5} and done.updated_at >= done.created_at
    assert store.count_jobs(t.id, ["succeeded"]) == 1 and store.count_jobs(t.id, ["queued", "running"]) == 0


def test_bad_job_input_and_unknown_ids(store):
    t = store.create_tenant("acme")
    j = store.create_job(t.id, "x", "sft", {}, "/w")
    with pytest.raises(ValueError, match="state"):
        store.set_job_state(j.id, "exploded")
    with pytest.raises(ValueError, match="progress"):
        store.set_job_progress(j.id, {"loss": float("nan")})
    with pytest.raises(ValueError, match="spec"):
        store.create_job(t.id, "x", "sft", {"f": object()}, "/w")
    with pytest.raises(ValueError, match="states"):
        store.list_jobs(t.id, states=["done"])
    with pytest.raises(ValueError, match="sha256"):
        store.add_checkpoint(t.id, "p", 1, "/c", 1, "nothex")
    with pytest.raises(KeyError, match="no job 'nope'"):
        store.set_job_state("nope", "running")
    with pytest.raises(KeyError, match="no tenant"):
        store.set_disabled("nope", True)
    with pytest.raises(KeyError, match="no tenant"):
        store.create_job("nope", "x", "sft", {}, "/w")
    assert store.get_job("nope") is None and store.get_tenant("nope") is None
    assert store.get_checkpoint("nope", t.id) is None and store.tenant_by_name("nope") is None
    assert [e.state for e in store.job_events(j.id)] == ["queued"]  # rejected calls wrote nothing


def test_unfinished_jobs_survive_reopen(open_store):
    s1 = open_store()
    t = s1.create_tenant("acme")
    queued = s1.create_job(t.id, "q", "sft", {}, "/w/q")
    running = s1.create_job(t.id, "r", "rl", {"env": "x"}, "/w/r")
    done = s1.create_job(t.id, "d", "eval", {}, "/w/d")
    s1.set_job_state(running.id, "running")
    s1.set_job_progress(running.id, {"step": 7})
    s1.set_job_state(done.id, "succeeded", result={"ok": True})
    _, secret = s1.create_key(t.id)
    s1.close()

    s2 = open_store()  # a restarted server
    assert [j.id for j in s2.unfinished_jobs()] == [queued.id, running.id]
    r = s2.get_job(running.id)
    assert r.state == "running" and r.progress == {"step": 7} and r.spec == {"env": "x"}
    assert s2.get_job(done.id).result == {"ok": True}
    assert [j.id for j in s2.list_jobs(t.id)] == [done.id, running.id, queued.id]  # newest first
    assert [e.state for e in s2.job_events(running.id)] == ["queued", "running"]
    assert s2.authenticate(secret).tenant_id == t.id
    s2.close()


def test_training_slots_have_their_own_records(open_store):
    s1 = open_store()
    a, b = s1.create_tenant("acme"), s1.create_tenant("beta")
    slot = s1.create_slot(a.id, "s1", "mine", {"head": {"kind": "gaussian"}}, "/w/s1")
    assert slot.state == "creating" and s1.list_jobs(a.id) == []  # a slot is not a job
    s1.set_slot_state(slot.id, "ready")
    gone = s1.create_slot(a.id, "s2", "old", {}, "/w/s2")
    s1.set_slot_state(gone.id, "deleted")
    s1.add_checkpoint(a.id, slot.id, 3, "/w/s1/x.safetensors", 10, SHA)
    assert s1.get_slot(slot.id, b.id) is None and s1.list_slots(b.id) == []  # another tenant's slot is not there
    with pytest.raises(ValueError, match="state must be one of"):
        s1.set_slot_state(slot.id, "running")
    with pytest.raises(KeyError, match="no training slot"):
        s1.set_slot_state("nope", "ready")
    s1.close()
    s2 = open_store()  # a restarted server restores the live ones
    assert [r.id for r in s2.live_slots()] == [slot.id]
    assert s2.get_slot(slot.id, a.id).spec == {"head": {"kind": "gaussian"}}
    assert [c.policy_version for c in s2.list_checkpoints(a.id, policy_id=slot.id)] == [3]
    s2.close()


def test_a_store_that_kept_slots_as_jobs_moves_them_to_their_table(open_store):
    """Stores written before training slots had a table held them as jobs of kind "slot"."""
    from vlamux.store.models import JobEventRow, JobRow, UsageRow

    s1 = open_store()
    t = s1.create_tenant("acme")
    job = s1.create_job(t.id, "j", "sft", {}, "/w/j")
    with s1._write() as s:  # written as the old code wrote a slot
        for sid, state in (("live", "running"), ("new", "queued"), ("broke", "failed"), ("del", "cancelled")):
            s.add(JobRow(id=sid, tenant_id=t.id, name=f"slot-{sid}", kind="slot", spec={"seed": 1}, state=state,
                         created_at=1.0, updated_at=1.0, error="why" if state == "failed" else None, result=None,
                         progress=None, workdir=f"/w/{sid}"))
            s.flush()
            s.add(JobEventRow(job_id=sid, at=1.0, state="queued", detail="created"))
            s.add(UsageRow(tenant_id=t.id, kind="train_steps", amount=2.0, job_id=sid, at=1.0))
    s1.add_checkpoint(t.id, "live", 4, "/w/live/a.safetensors", 10, SHA)
    s1.close()
    s2 = open_store()
    assert [j.id for j in s2.list_jobs(t.id)] == [job.id]
    states = {r.id: r.state for r in s2.list_slots(t.id)}
    assert states == {"live": "ready", "new": "creating", "broke": "failed", "del": "deleted"}
    assert s2.get_slot("broke").error == "why" and s2.get_slot("live").workdir == "/w/live"
    assert {r.id for r in s2.live_slots()} == {"live", "new"}
    assert s2.list_checkpoints(t.id, policy_id="live")[0].policy_version == 4
    assert s2.usage_totals(t.id) == {t.id: {"train_steps": 8.0}}  # usage kept, no longer naming a job
    s2.close()
    s3 = open_store()  # opening again moves nothing twice
    assert len(s3.list_slots(t.id)) == 4 and [j.id for j in s3.list_jobs(t.id)] == [job.id]
    s3.close()


def test_concurrent_usage_and_state_writes_are_exact(store):
    tenants = [store.create_tenant(f"t{i}").id for i in range(2)]
    jobs = [store.create_job(tenants[0], f"j{i}", "sft", {}, "/w").id for i in range(8)]
    errors = []

    def worker(i):
        try:
            tid = tenants[i % 2]
            for n in range(200):
                if n % 50 == 0:  # read-then-write transactions contend too
                    store.set_job_state(jobs[i], "running", detail=str(n))
                if n % 2:
                    store.record_usage(tid, "gpu_s", 0.25, job_id=jobs[i])
                else:
                    store.record_usage_many([(tid, "steps", 1, None), (tid, "gpu_s", 0.25, None)])
        except Exception as e:  # surfaced below; a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    # 4 threads per tenant x (100 single + 100 double rows): gpu_s 4*200*0.25, steps 4*100
    expected = {"gpu_s": 200.0, "steps": 400.0}
    assert store.usage_totals() == {tenants[0]: expected, tenants[1]: expected}
    assert store.usage_totals(tenants[1]) == {tenants[1]: expected}
    assert store.usage_totals(since=store_mod.time.time() + 10) == {}
    assert all(len(store.job_events(j)) == 1 + 4 for j in jobs)


def test_record_usage_many_is_all_or_nothing(store):
    t = store.create_tenant("acme")
    with pytest.raises(ValueError, match="amount"):
        store.record_usage_many([(t.id, "gpu_s", 1.0, None), (t.id, "gpu_s", float("inf"), None)])
    assert store.usage_totals() == {}


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "slash/name", "semi;colon", "newline\n", 7, None])
def test_bad_tenant_names_raise_naming_name(store, bad):
    with pytest.raises(ValueError, match="name"):
        store.create_tenant(bad)


def test_tenant_crud_and_duplicate_name(store):
    t = store.create_tenant("team-1.a_b", quotas={"gpu_s": 100})
    with pytest.raises(ValueError, match="exists"):
        store.create_tenant("team-1.a_b")
    assert store.tenant_by_name("team-1.a_b") == t
    assert store.set_quotas(t.id, {"gpu_s": 5}).quotas == {"gpu_s": 5}
    assert store.set_disabled(t.id, True).disabled is True
    assert store.get_tenant(t.id).disabled is True and store.get_tenant(t.id).quotas == {"gpu_s": 5}
    assert [x.name for x in store.list_tenants()] == ["team-1.a_b"]
    with pytest.raises(ValueError, match="quotas"):
        store.set_quotas(t.id, ["not", "a", "dict"])


def test_ensure_admin_key(open_store):
    s = open_store()
    first = s.ensure_admin_key(None)
    assert first is not None and s.authenticate(first).is_admin
    assert s.ensure_admin_key(None) is None  # one exists: nothing new
    assert s.ensure_admin_key("env-secret-123") == "env-secret-123"  # configured secret added
    assert s.authenticate("env-secret-123").is_admin and s.authenticate(first).is_admin
    assert s.ensure_admin_key("env-secret-123") is None
    assert len(s.list_keys(None)) == 2
    s.close()

    s = open_store()  # restart with the same configured secret: still valid, not duplicated
    assert s.ensure_admin_key("env-secret-123") is None and len(s.list_keys(None)) == 2
    admin = s.authenticate("env-secret-123")
    assert s.revoke_key(admin.id, None) is True
    assert s.ensure_admin_key("env-secret-123") is None  # a revoked secret stays revoked
    assert s.authenticate("env-secret-123") is None
    t = s.create_tenant("acme")
    _, tenant_secret = s.create_key(t.id)
    with pytest.raises(ValueError, match="tenant"):
        s.ensure_admin_key(tenant_secret)  # a tenant key must never be promoted to admin
    assert not s.authenticate(tenant_secret).is_admin
    s.close()

    fresh = open_store("fresh")  # first start with a configured secret uses it
    assert fresh.ensure_admin_key("boot") == "boot" and fresh.ensure_admin_key(None) is None
    fresh.close()


def _writer(url: str, data_dir: str | None, tenant_id: str, job_ids: list[str], n: int) -> None:
    """One server process's writes: usage rows and job transitions, through a Store of its own."""
    s = Store(url, data_dir) if url else Store(data_dir=data_dir)
    try:
        for i in range(n):
            s.record_usage_many([(tenant_id, "steps", 1, None), (tenant_id, "gpu_s", 0.5, job_ids[i % len(job_ids)])])
            if i % 20 == 0:
                s.set_job_state(job_ids[i % len(job_ids)], "running", detail=f"{tenant_id}:{i}")
    finally:
        s.close()


def test_concurrent_writers_in_several_processes_lose_nothing(open_store):
    """Four processes write to one store at once (as API hosts on one PostgreSQL would): every row
    and every transition is there afterwards."""
    import multiprocessing as mp

    s = open_store()
    t = s.create_tenant("many")
    jobs = [s.create_job(t.id, f"j{i}", "sft", {}, "/w").id for i in range(4)]
    url = None if s.url.startswith("sqlite") else s.url
    data_dir = s.url.removeprefix("sqlite:///").rsplit("/", 1)[0] if url is None else None
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, data_dir, t.id, jobs, 100)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    assert s.usage_totals(t.id) == {t.id: {"steps": 400.0, "gpu_s": 200.0}}
    assert sum(len(s.job_events(j)) - 1 for j in jobs) == 4 * 5  # 5 transitions per process, none lost
    s.close()


def test_usage_is_kept_by_the_hour_and_each_write_adds_to_its_row(store):
    """A meter writes four times a second: the rows are one per tenant, kind, job and hour, not one a
    write, and the totals are exact."""
    from sqlalchemy import func, select

    from vlamux.store.models import UsageRow

    t = store.create_tenant("acme")
    job = store.create_job(t.id, "j", "sft", {}, "/w").id
    for _ in range(50):
        store.record_usage_many([(t.id, "gpu_s", 0.25, job), (t.id, "gpu_s", 0.5, None), (t.id, "steps", 1, job)])
    assert store.usage_totals(t.id) == {t.id: {"gpu_s": 37.5, "steps": 50.0}}
    with store._read() as s:
        rows = s.scalar(select(func.count()).select_from(UsageRow))
    assert rows <= 3 * 2, rows  # an hour boundary during the loop makes a second row each at most


def test_pruning_a_tenants_job_history_keeps_its_usage_and_touches_no_one_else(store):
    """Finished jobs past the `keep` newest leave with their events and checkpoints; running and
    spared jobs stay; the tenant's usage totals do not change; another tenant's jobs are untouched."""
    a, b = store.create_tenant("a"), store.create_tenant("b")
    jobs = []
    for i in range(5):
        j = store.create_job(a.id, f"j{i}", "sft", {}, f"/w/{i}").id
        store_mod.time.sleep(0.002)  # created_at orders them
        store.set_job_state(j, "succeeded" if i < 4 else "running")
        store.add_checkpoint(a.id, j, 1, f"/w/{i}/c.safetensors", 10, SHA, job_id=j)
        store.record_usage_many([(a.id, "gpu_s", 1.0 + i, j), (a.id, "steps", 2, j)])
        jobs.append(j)
    other = store.create_job(b.id, "old", "sft", {}, "/w/b").id
    store.set_job_state(other, "succeeded")
    store.record_usage(b.id, "gpu_s", 7.0, job_id=other)
    before = store.usage_totals()
    gone = store.prune_jobs(a.id, keep=1, spare=[jobs[0]])
    # finished newest first: j3 (kept: keep=1), j2, j1, j0 (spared) -> j2 and j1 go; j4 runs
    assert sorted(r.id for r in gone) == sorted([jobs[1], jobs[2]])
    assert {r.id for r in store.list_jobs(a.id)} == {jobs[0], jobs[3], jobs[4]}
    assert store.usage_totals() == before
    assert store.job_events(jobs[1]) == [] and store.list_checkpoints(a.id, job_id=jobs[2]) == []
    assert len(store.list_checkpoints(a.id)) == 3
    assert [r.id for r in store.list_jobs(b.id)] == [other] and store.prune_jobs(a.id, keep=1, spare=[jobs[0]]) == []
    with pytest.raises(ValueError, match="keep"):
        store.prune_jobs(a.id, keep=-1)
    store.record_usage(a.id, "gpu_s", 0.5, job_id=jobs[1])  # metered late, for a job gone: the tenant's still
    assert store.usage_totals(a.id)[a.id]["gpu_s"] == before[a.id]["gpu_s"] + 0.5
