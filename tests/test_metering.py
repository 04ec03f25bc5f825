"""The Meter's arithmetic over the services' counters (vlamux/api/metering.py): each service's idle
keys go (vlamux/services/accounting.py), and what is recorded stays exact. The services here are two
real `Accounting`s behind a runtime stand-in (a runtime's `accounting()` and its environment's
`env_steps()`, all the Meter reads): a full runtime adds nothing to this arithmetic but seconds."""

import time
import types

from vlamux.api.metering import Meter
from vlamux.services.accounting import Accounting
from vlamux.store import Store


def test_a_key_one_service_lets_go_is_counted_once_and_counts_again_from_zero(tmp_path):
    store = Store(None, tmp_path)
    tenant = store.create_tenant("acme")
    job = store.create_job(tenant.id, "j", "sft", {}, "/w").id
    key = f"{tenant.id}/{job}"
    training, replica = Accounting(idle_s=0.05), Accounting()
    runtime = types.SimpleNamespace(
        accounting=lambda: {"training": training.snapshot(), "inference-0": replica.snapshot()},
        environment=types.SimpleNamespace(env_steps=dict))
    meter = Meter(types.SimpleNamespace(runtime=runtime, store=store))
    training.charge(key, backbone_s=2.0, requests=0.0)
    replica.charge(key, backbone_s=1.0, requests=3.0)
    meter.tick()
    time.sleep(0.1)  # the training service's key is idle past its limit: it goes at the next look
    replica.charge(key, requests=1.0)
    meter.tick()
    assert key not in training.snapshot()["tenants"] and key in replica.snapshot()["tenants"]
    training.charge(key, backbone_s=0.5)  # charged again: a new key, from zero
    meter.tick()
    meter.tick()
    assert store.usage_totals(tenant.id)[tenant.id] == {"backbone_s": 3.5, "requests": 4.0}
    assert store.list_jobs(tenant.id)[0].id == job
