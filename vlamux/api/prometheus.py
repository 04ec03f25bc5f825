"""`/metrics` in Prometheus's text format, read from the services at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vlamux.api.responses import CLASSES
from vlamux.store import SLOT_STATES


class _Collector:
    def __init__(self, host):
        self.host = host

    def collect(self):
        rt, store = self.host.runtime, self.host.store
        m = rt.metrics()
        depth = GaugeMetricFamily("vlamux_queue_depth", "Requests waiting in a queue", labels=["queue", "service"])
        wait = GaugeMetricFamily("vlamux_queue_wait_seconds", "Queue wait, by quantile",
                                 labels=["queue", "service", "quantile"])
        rows = GaugeMetricFamily("vlamux_group_rows_mean", "Mean rows per group (one backbone forward)",
                                 labels=["queue", "service"])
        reqs = GaugeMetricFamily("vlamux_group_requests_mean", "Mean requests per group", labels=["queue", "service"])
        util = GaugeMetricFamily("vlamux_service_utilization", "Busy time over wall time since the service started",
                                 labels=["service"])
        busy = CounterMetricFamily("vlamux_service_busy_seconds", "Busy time (rate() of it is live utilisation)",
                                   labels=["service"])
        groups = CounterMetricFamily("vlamux_groups", "Groups executed", labels=["queue", "service"])
        slots = GaugeMetricFamily("vlamux_service_slots", "Tenant slots each model service holds (training: with "
                                  "optimizer state; a replica: serving copies)", labels=["service"])
        memory = GaugeMetricFamily("vlamux_device_memory_bytes", "Device memory by pool (model: weights, slots and "
                                   "activations; rollout: data-plane inputs), reserved, allocated and peak "
                                   "allocated; zero on a CPU", labels=["device", "pool", "kind"])
        info = GaugeMetricFamily("vlamux_service_placement", "Where each model service runs (value 1)",
                                 labels=["service", "device", "dtype", "fuse_heads"])
        cap = GaugeMetricFamily("vlamux_group_cap_rows", "The group size each model service learned from its "
                                "hardware: its groups hold at most this many rows", labels=["service", "backbone"])
        curve = GaugeMetricFamily("vlamux_backbone_forward_seconds", "The backbone's measured forward time by rows "
                                  "(the curve the cap comes from)", labels=["service", "backbone", "rows"])
        tenant_mem = GaugeMetricFamily("vlamux_tenant_memory_bytes", "What each tenant's slot costs a model service "
                                       "(its head or imported expert, adapter, query tokens, optimizer state): "
                                       "the shared backbone is counted once, in vlamux_device_memory_bytes",
                                       labels=["service", "tenant", "part"])
        tiers = GaugeMetricFamily("vlamux_slot_tier", "Serving slots of a replica that pages them (--slot-memory-mb), "
                                  "by tier: resident (on its device), parked (host memory), stored (disk)",
                                  labels=["service", "tier", "what"])
        moves = CounterMetricFamily("vlamux_slot_moves", "Slot moves between tiers (park, store, load)",
                                    labels=["service", "move"])
        pools_seen: dict = {}
        queues = [("training", "training", m["training"])] + [("inference", n, v) for n, v in m["inference"].items()]
        for queue, name, svc in queues:
            q = svc["queue"]
            depth.add_metric([queue, name], q.get("depth", q.get("depth_requests", 0)))
            wait.add_metric([queue, name, "0.5"], q["wait_p50_s"])
            wait.add_metric([queue, name, "0.99"], q["wait_p99_s"])
            rows.add_metric([queue, name], q["group_rows_mean"])
            reqs.add_metric([queue, name], q["group_requests_mean"])
            groups.add_metric([queue, name], q["groups"])
            for bid, c in (svc.get("group_caps") or {}).items():
                if c.get("rows") is not None:
                    cap.add_metric([name, bid], c["rows"])
                for r, sec in c.get("curve", []):
                    curve.add_metric([name, bid, str(r)], sec)
            util.add_metric([name], svc["utilization"])
            busy.add_metric([name], svc.get("busy_s", 0.0))
            slots.add_metric([name], svc.get("tenants", 0))
            for tenant, parts in (svc.get("tenant_memory") or {}).items():
                for part, n in parts.items():
                    tenant_mem.add_metric([name, tenant, part], n)
            for tier in ("resident", "parked", "stored") if svc.get("slots") else ():
                tiers.add_metric([name, tier, "count"], svc["slots"][tier]["count"])
                tiers.add_metric([name, tier, "bytes"], svc["slots"][tier]["bytes"])
            for move, n in (svc.get("slots") or {}).get("moves", {}).items():
                moves.add_metric([name, move], n)
            if "device" in svc:
                info.add_metric([name, svc["device"], svc["dtype"], str(svc.get("fuse_heads", False)).lower()], 1)
            mem, device = svc.get("memory"), svc.get("device", "cpu")
            if mem:  # the model pool is the device's; each service has a rollout pool of its own
                per_device = pools_seen.setdefault(device, {"model": mem["model"], "rollout": {}})
                for kind, v in mem["rollout"].items():
                    per_device["rollout"][kind] = per_device["rollout"].get(kind, 0) + v
        for device, pools in pools_seen.items():
            for pool in ("model", "rollout"):
                for kind in ("reserved", "allocated", "peak_allocated"):
                    memory.add_metric([device, pool, kind], pools[pool].get(f"{kind}_bytes", 0))
        env = m["environment"]
        util.add_metric(["environment"], env["utilization"])
        busy.add_metric(["environment"], env["busy_s"])
        yield from (depth, wait, rows, reqs, util, busy, groups, slots, tenant_mem, tiers, moves, memory, info, cap,
                    curve)
        sessions = GaugeMetricFamily("vlamux_env_sessions", "Open simulator sessions")
        sessions.add_metric([], env["open_sessions"])
        yield sessions
        restarts = CounterMetricFamily("vlamux_role_restarts", "Restarts by the Health Manager", labels=["role"])
        for role, n in m["health"].items():
            restarts.add_metric([role], n)
        yield restarts
        usage = CounterMetricFamily("vlamux_tenant_usage", "Per-tenant usage since the store began",
                                    labels=["tenant", "kind"])
        names = {t.id: t.name for t in store.list_tenants()}
        for tid, kinds in store.usage_totals().items():
            for kind, v in kinds.items():
                usage.add_metric([names.get(tid, tid), kind], v)
        yield usage
        jobs = GaugeMetricFamily("vlamux_jobs", "Jobs on record by state (finished ones within the job history kept)",
                                 labels=["state"])
        counts = store.job_counts()
        for state in ("queued", "running", "succeeded", "failed", "cancelled"):
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        answers = CounterMetricFamily("vlamux_http_responses", "HTTP answers by status class", labels=["code"])
        with self.host.responses_lock:
            seen = dict(self.host.responses)
        for code in CLASSES:
            answers.add_metric([code], seen.get(code, 0))
        yield answers
        slots = GaugeMetricFamily("vlamux_training_slots", "Training slots by state", labels=["state"])
        counts = {}
        for rec in store.list_slots():
            counts[rec.state] = counts.get(rec.state, 0) + 1
        for state in SLOT_STATES:
            slots.add_metric([state], counts.get(state, 0))
        yield slots


def render(host) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(host))
    return generate_latest(registry)
