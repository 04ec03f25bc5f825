"""Many tenants on one replica: serving slots paged between resident, parked (host) and stored (disk).

For each kind of tenant module (`heads`: a Gaussian head; `lora8`: the same head and a rank-8 LoRA on
the backbone's default targets) and each N registered tenants (100, 1,000, 10,000), one Inference
Model Service of the built-in `small` backbone holds every tenant, within a resident budget of
--resident-slots slots and a host budget of --parked-slots (the rest stored in its spool). The three
N of one kind run side by side, their measuring windows interleaved (N=100, 1,000, 10,000, then again),
so a drift of this machine's speed hits all alike.

Load: --clients closed-loop clients, each drawing its next request's tenant from a Zipf law (s = 1) over
a fixed random order of all N tenants and pausing --think-s after each answer (a robot executing its
action chunk: the replica runs below saturation, so a latency is service, not a fair queue's turn);
--hot-clients more ask the rank-1 tenant (the hot tenant) only, so that its latency has samples enough
for a p99 on a machine that serves tens of rows a second. One 128x128 camera and one row a request.

Figures per cell:
  hot_p50/p99_s       the hot tenant's request latency (submit to answer), all its requests
  hit/miss p50/p99_s  requests whose slot was / was not resident when they came
  load_wait_p50/p99_s a slot's wait for paging, from its oldest request (or, if later, the slot's leaving
                      the resident tier while that request waited) to resident (the service's timestamps)
  disk_read_p50/p99_s, read_to_resident_p50/p99_s  a load from disk in two parts: its read on a reader
                      thread (queued and read), then from the read's end to resident (the mover's turn)
  hit_rate, requests_per_s, resident/parked/stored counts, the largest resident bytes seen against
  the budget (sampled every 0.25 s), and the process's memory growth at registration against
  (slots registered) x (module bytes of the head built apart).
Limits, measured apart (plain torch and safetensors, no vlamux paging code), interleaved:
  group_forward_s     the backbone's forward of the cell's median group rows
  slot_load_s         safetensors.load_file of one tenant's module (head and adapter) + copy into a head
                      (and adapter-shaped buffers) built apart
  cold_limit_s        their p99s summed; the target: load_wait_p99_s <= cold_limit_s
Target: hot_p99 at N=10,000 <= 1.1 x hot_p99 at N=100 (same kind, same run).

    python bench/many_tenants.py [--quick] [--tenants 100,1000,10000] [--kinds heads,lora8] [--device cuda]
On CUDA the resident tier is device memory, the parked one pinned host memory, and the moves run on
the replica's page stream, beside its groups.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from itertools import accumulate
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ResultFile, environment, print_table  # noqa: E402

from vlamux.model import BackboneSpec, HeadSpec, ModelRunner, OptimizerSpec, build_backbone  # noqa: E402
from vlamux.model.device import add_device_arguments, parse_device_arguments  # noqa: E402
from vlamux.model.heads import build_head  # noqa: E402
from vlamux.model.slot_file import MODULE_PREFIXES  # noqa: E402
from vlamux.model.snapshot import PolicySnapshot  # noqa: E402
from vlamux.model.synthetic import TaskProfile, make_batch  # noqa: E402
from vlamux.services.inference import InferenceModelService  # noqa: E402
from vlamux.services.pager import SlotBudget  # noqa: E402
from vlamux.services.queues import InferenceQueueConfig  # noqa: E402
from vlamux.utils.stats import quantile  # noqa: E402

HEAD = HeadSpec("gaussian", 7, 8, 8, width=64, depth=1)
LIMIT_REPEATS = 100  # each limit's samples: a p99 of fewer is its largest sample
KINDS = {"heads": HEAD, "lora8": HeadSpec("gaussian", 7, 8, 8, width=64, depth=1, adapter={"rank": 8})}


def profile(image_size: int) -> TaskProfile:
    """One camera of image_size px, the heads' action and state sizes."""
    return TaskProfile({"top": (image_size, image_size)}, 7, 8, 8, "reach the {color} block")


def rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def snapshots(backbone, spec: HeadSpec, n: int):
    """n tenants' serving policies: one slot's tensors, each tenant's own perturbation of them."""
    template = ModelRunner(backbone).create_slot("template", spec, OptimizerSpec(), seed=0).export_policy()
    module = {k: v for k, v in template.tensors.items() if k.startswith(MODULE_PREFIXES)}
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        tensors = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in module.items()}
        tensors.update({k: v for k, v in template.tensors.items() if k not in module})
        yield PolicySnapshot(f"t{i:05d}", 0, template.backbone_id, spec, tensors, template.stats_modes)


def module_bytes(backbone, spec: HeadSpec) -> int:
    """A tenant's module bytes from the head (and adapter) built apart on the meta device."""
    from vlamux.model.adapters import LoRAAdapter, select_targets

    with torch.device("meta"):
        head = build_head(spec, backbone.meta.hidden_dim, False)
        total = sum(p.numel() * p.element_size() for p in head.parameters())
        total += sum(b.numel() * b.element_size() for b in head.buffers())
        if spec.adapter is not None:
            targets = select_targets(backbone.adaptable(), spec.lora, backbone.LORA_DEFAULT)
            total += sum(p.numel() * p.element_size() for p in LoRAAdapter(spec.lora, targets).parameters())
    return total


class Cell:
    def __init__(self, backbone, kind: str, n: int, args, one: int):
        self.kind, self.n, self.one, self.profile = kind, n, one, profile(args.image_size)
        self.budget = SlotBudget(resident_bytes=args.resident_slots * one, parked_bytes=args.parked_slots * one)
        self.svc = InferenceModelService(backbone, InferenceQueueConfig(batch_rows=args.batch_rows,
                                                                        max_wait_s=args.max_wait_ms / 1000),
                                         name=f"{kind}-{n}", group_cap=None, slot_budget=self.budget).start()
        before, t0 = rss_bytes(), time.perf_counter()
        for i, snap in enumerate(snapshots(backbone, KINDS[kind], n)):
            self.svc.stage_policy(snap)
            if i % 250 == 249:
                self._registered(i + 1)
        self._registered(n, settled=True)
        self.register_s = time.perf_counter() - t0
        self.rss_growth = rss_bytes() - before
        order = [f"t{i:05d}" for i in range(n)]
        random.Random(n).shuffle(order)  # rank 1 first
        self.order = order
        self.cdf = list(accumulate(1.0 / (r + 1) for r in range(n)))
        self.samples: list[tuple[str, float, bool]] = []  # (who, latency, resident when it came)
        self.groups: list[int] = []
        self.load_waits: list[float] = []
        self.reads: list[float] = []  # a load from disk: its read, then from the read's end to resident
        self.pickups: list[float] = []
        self.max_resident = self.max_resident_count = 0
        self.busy_s = self.wall_s = self.measured_s = 0.0
        self.group_s: list[float] = []
        self.page_s: list[float] = []
        print(f"  {kind} N={n}: registered in {self.register_s:.1f}s, {self.svc.metrics()['slots']}", flush=True)

    def _registered(self, n: int, timeout_s: float = 600.0, settled: bool = False) -> None:
        """Wait until the service knows n tenants (staged ones are applied between its rounds), and
        (settled) its mover has stored what the host budget does not hold."""
        deadline = time.monotonic() + timeout_s
        while True:
            slots = self.svc.metrics()["slots"]
            if sum(slots[t]["count"] for t in ("resident", "parked", "stored")) >= n and (
                    not settled or slots["parked"]["bytes"] <= self.budget.parked_bytes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} tenants not registered after {timeout_s}s: {slots}")
            time.sleep(0.02)

    def draw(self, rng: random.Random) -> str:
        return self.order[bisect_left(self.cdf, rng.random() * self.cdf[-1])]

    def window(self, clients: int, hot_clients: int, seconds: float, warm_s: float, think_s: float) -> None:
        """Closed-loop clients for `seconds`, each waiting `think_s` after an answer (a robot executing
        its action chunk); requests that came in the first `warm_s` are not counted."""
        stop, start = threading.Event(), time.monotonic()
        counted = start + warm_s
        queue = self.svc.queue
        groups0 = len(queue.stats.group_rows)
        lock = threading.Lock()
        for xs in (self.svc.tiers.load_s, self.svc.tiers.read_s, self.svc.tiers.pickup_s):
            xs.clear()
        self.svc.accounting.group_s.clear()
        self.svc.tiers.page_s.clear()

        def client(k: int, always_hot: bool) -> None:
            rng, g = random.Random(k * 7919 + self.n), torch.Generator().manual_seed(k)
            obs = make_batch(self.profile, 1, g)[0]
            stop.wait(rng.uniform(0, think_s))  # the clients' phases spread over a think time
            while not stop.is_set():
                hot = always_hot
                tenant = self.order[0] if hot else self.draw(rng)
                hot = hot or tenant == self.order[0]
                resident = self.svc.tiers.resident(tenant)
                t0 = time.monotonic()
                self.svc.predict(tenant, obs).result(300)
                if t0 >= counted:
                    with lock:
                        self.samples.append(("hot" if hot else tenant, time.monotonic() - t0, resident))
                stop.wait(think_s)

        threads = [threading.Thread(target=client, args=(k, k >= clients), daemon=True)
                   for k in range(clients + hot_clients)]
        busy0 = self.svc.accounting.busy_s
        for t in threads:
            t.start()
        while time.monotonic() < start + warm_s + seconds:
            usage = self.svc.tiers.pager.usage()["resident"]
            self.max_resident = max(self.max_resident, usage["bytes"])
            self.max_resident_count = max(self.max_resident_count, usage["count"])
            time.sleep(0.25)
        stop.set()
        for t in threads:
            t.join(300)
        self.groups += list(queue.stats.group_rows)[groups0:]
        self.load_waits += list(self.svc.tiers.load_s)
        self.reads += list(self.svc.tiers.read_s)
        self.pickups += list(self.svc.tiers.pickup_s)
        self.group_s += list(self.svc.accounting.group_s)
        self.page_s += list(self.svc.tiers.page_s)
        self.busy_s += self.svc.accounting.busy_s - busy0
        self.wall_s += time.monotonic() - start
        self.measured_s += seconds

    def figures(self) -> dict:
        hot = [lat for who, lat, _ in self.samples if who == "hot"]
        hits = [lat for who, lat, res in self.samples if who != "hot" and res]
        misses = [lat for who, lat, res in self.samples if who != "hot" and not res]
        slots = self.svc.metrics()["slots"]
        return {"kind": self.kind, "tenants": self.n, "module_bytes": self.one,
                "budget_resident_bytes": self.budget.resident_bytes, "budget_parked_bytes": self.budget.parked_bytes,
                "register_s": self.register_s, "rss_growth_bytes": self.rss_growth,
                "rss_growth_over_formula": self.rss_growth / (self.n * self.one),  # every tenant in memory
                # what the host holds on a CPU: the resident and parked tiers (the stored are on disk)
                "rss_growth_over_held": self.rss_growth / (self.one * sum(
                    self.svc.tiers.pager.usage()[t]["count"] for t in ("resident", "parked"))),
                "max_resident_bytes": self.max_resident, "max_resident_count": self.max_resident_count,
                "within_budget": self.max_resident <= self.budget.resident_bytes,
                "requests": len(self.samples), "requests_per_s": len(self.samples) / self.measured_s,
                "service_busy": self.busy_s / self.wall_s,
                "service_group_p50_s": quantile(self.group_s, 0.5), "service_group_p99_s": quantile(self.group_s, 0.99),
                "paging_round_p50_s": quantile(self.page_s, 0.5), "paging_round_p99_s": quantile(self.page_s, 0.99),
                "hot_requests": len(hot), "hot_p50_s": quantile(hot, 0.5), "hot_p99_s": quantile(hot, 0.99),
                "hit_rate": len(hits) / max(1, len(hits) + len(misses)),
                "hit_p50_s": quantile(hits, 0.5), "hit_p99_s": quantile(hits, 0.99),
                "miss_p50_s": quantile(misses, 0.5), "miss_p99_s": quantile(misses, 0.99),
                "load_waits": len(self.load_waits), "load_wait_p50_s": quantile(self.load_waits, 0.5),
                "load_wait_p99_s": quantile(self.load_waits, 0.99),
                "disk_read_p50_s": quantile(self.reads, 0.5), "disk_read_p99_s": quantile(self.reads, 0.99),
                "read_to_resident_p50_s": quantile(self.pickups, 0.5),
                "read_to_resident_p99_s": quantile(self.pickups, 0.99),
                "median_group_rows": statistics.median(self.groups) if self.groups else None,
                "tiers": {t: slots[t] for t in ("resident", "parked", "stored")}, "moves": slots["moves"],
                "loads_from": slots.get("loads_from")}

    def close(self) -> None:
        self.svc.stop()
        self.svc.tiers.close()


def limits(backbone, spec: HeadSpec, rows: int, repeats: int, image_size: int) -> dict:
    """One group's forward and one slot's load from disk, each the plain way, interleaved (on CUDA each
    timed to its end: a device-wide synchronize, here, is the plain way's)."""
    from safetensors.torch import load_file, save_file

    device = backbone.device
    done = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    g = torch.Generator().manual_seed(0)
    batch = [backbone.prepare(make_batch(profile(image_size), 1, g)[0]) for _ in range(rows)]
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, snap in enumerate(snapshots(backbone, spec, 8)):
            paths.append(Path(d) / f"{i}.safetensors")
            # the tenant's whole module: the head, and the adapter where it has one
            save_file({k: v.contiguous() for k, v in snap.tensors.items() if k.startswith(MODULE_PREFIXES)},
                      str(paths[-1]))
        with torch.device("meta"):
            head = build_head(spec, backbone.meta.hidden_dim, False)
        head = head.to_empty(device=device)
        # the adapter's tensors land in buffers of their own shapes (what a LoRA built apart would hold)
        others = {k: torch.empty_like(v, device=device) for k, v in load_file(str(paths[0])).items()
                  if not k.startswith("head.")}

        def forward():
            with torch.no_grad():
                backbone.forward_group(batch)
            done()

        def load(i=[0]):
            tensors = load_file(str(paths[i[0] % len(paths)]))
            i[0] += 1
            head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items() if k.startswith("head.")},
                                 strict=False)
            for k, buf in others.items():
                buf.copy_(tensors[k])
            done()

        times = {"group_forward_s": [], "slot_load_s": []}
        forward(), load()
        for _ in range(repeats):
            for name, fn in (("group_forward_s", forward), ("slot_load_s", load)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    out = {k: {"p50": quantile(v, 0.5), "p99": quantile(v, 0.99), "n": len(v)} for k, v in times.items()}
    out["rows"] = rows
    out["cold_limit_s"] = out["group_forward_s"]["p99"] + out["slot_load_s"]["p99"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N 100 and 1,000 of heads only, short windows")
    ap.add_argument("--tenants", default=None, help="comma-separated N (default 100,1000,10000)")
    ap.add_argument("--kinds", default=None, help="comma-separated of heads, lora8 (default both)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--hot-clients", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=8.0,
                    help="each client's pause after an answer (a robot executing its chunk); 0: back to back")
    ap.add_argument("--resident-slots", type=int, default=200)
    ap.add_argument("--parked-slots", type=int, default=1000)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per window (default 20; quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="windows per cell (default 3; quick 1)")
    ap.add_argument("--backbone", default="small", help="built-in preset (the issue's: small)")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--out", default=None)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device, dtype = parse_device_arguments(ap, args)
    tenants = [int(x) for x in (args.tenants or ("100,1000" if args.quick else "100,1000,10000")).split(",")]
    kinds = (args.kinds or ("heads" if args.quick else "heads,lora8")).split(",")
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    rounds = args.rounds or (1 if args.quick else 3)
    torch.manual_seed(0)
    backbone = build_backbone(BackboneSpec(preset=args.backbone), device=device, dtype=dtype)
    planned = [f"{k}:{n}" for k in kinds for n in tenants]
    out = ResultFile("many_tenants_quick.json" if args.quick and not args.out else "many_tenants.json", args.out,
                     planned, environment=environment(device, dtype),
                     setting={"backbone": args.backbone, "image_size": args.image_size, "head": HEAD.to_json(), "clients": args.clients,
                              "hot_clients": args.hot_clients, "think_s": args.think_s, "zipf_s": 1.0, "resident_slots": args.resident_slots,
                              "parked_slots": args.parked_slots, "batch_rows": args.batch_rows,
                              "max_wait_ms": args.max_wait_ms, "window_s": seconds, "rounds": rounds,
                              "cameras": 1, "rows_per_request": 1})
    for kind in kinds:
        one = module_bytes(backbone, KINDS[kind])
        cells = [Cell(backbone, kind, n, args, one) for n in tenants]
        try:
            for r in range(rounds):
                for cell in (cells if r % 2 == 0 else cells[::-1]):
                    cell.window(args.clients, args.hot_clients, seconds, warm_s=2.0 if r == 0 else 1.0,
                                think_s=args.think_s)
            rows = int(statistics.median([c.figures()["median_group_rows"] or 1 for c in cells]))
            limit = limits(backbone, KINDS[kind], rows, max(LIMIT_REPEATS, 10 * rounds), args.image_size)
            base = next(c for c in cells if c.n == min(tenants)).figures()
            for cell in cells:
                f = cell.figures()
                f["limits"] = limit
                f["load_wait_p99_over_limit"] = (f["load_wait_p99_s"] / limit["cold_limit_s"]
                                                 if f["load_wait_p99_s"] is not None else None)
                f["hot_p99_over_smallest_n"] = (f["hot_p99_s"] / base["hot_p99_s"]
                                                if f["hot_p99_s"] and base["hot_p99_s"] else None)
                out.cell(f"{kind}:{cell.n}", f)
        finally:
            for cell in cells:
                cell.close()
    out.finish()
    rows = [{"cell": f"{c['kind']}:{c['tenants']}", "hit": c["hit_rate"], "rps": c["requests_per_s"],
             "hot_p99": c["hot_p99_s"] or 0.0, "hot_ratio": c["hot_p99_over_smallest_n"] or 0.0,
             "load_p99": c["load_wait_p99_s"] or 0.0, "limit": c["limits"]["cold_limit_s"],
             "max_res_mb": c["max_resident_bytes"] / 2**20, "budget_mb": c["budget_resident_bytes"] / 2**20}
            for c in out.payload["cells"]]
    print_table(rows, [("cell", ""), ("hit", ".3f"), ("rps", ".1f"), ("hot_p99", ".3f"), ("hot_ratio", ".2f"),
                       ("load_p99", ".3f"), ("limit", ".3f"), ("max_res_mb", ".1f"), ("budget_mb", ".1f")])
    print(f"wrote {out.path}")


if __name__ == "__main__":
    main()
