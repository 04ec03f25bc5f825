"""Screenshots of the web dashboard for the README (docs/img/dashboard.png, docs/img/dashboard-admin.png).

Starts the real service on a free localhost port with a fresh data directory, generates a small
demonstration dataset, lets two tenants run a few jobs (acme: a 200-step SFT job and an RL job
warm-started by SFT, 100k env steps of PPO as docs/RESULTS.md measured it to learn; bolt: an SFT job
with a flow head), then opens /dashboard in headless Chromium (Debian's `chromium` +
`chromium-driver`, see scripts/setup-system.sh) with acme's key and with the admin key and saves a
full-page screenshot of each. About fifteen minutes on a 2-core machine (`--rl-env-steps 3000`: three).

    python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png] [--admin-out docs/img/dashboard-admin.png]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from vlamux.sdk.http import call

HEAD = {"kind": "gaussian", "action_dim": 4, "horizon": 8, "state_dim": 8}
ENV = {"task": "goal/touch-red-cube", "image_size": 32, "n_action_steps": 4, "max_steps": 120}


def jobs(steps: int, rl_env_steps: int) -> dict[str, list[dict]]:
    acme = [{"name": "bc-touch-red", "kind": "sft", "head": HEAD, "optimizer": {"lr": 3e-4},
             "sft": {"dataset": "demos", "steps": steps, "batch_size": 16}, "checkpoint_every": 50}]
    if rl_env_steps:
        # the Gaussian tenant of scripts/experiments/flow_rl.py (docs/RESULTS.md, "RL for flow heads"):
        # 300 SFT steps on the DART demonstrations, then PPO on whole episodes of both sub-batches per
        # update (sync; 30 chunks of 4 actions = 120 steps), the dense reward, the critic fitted first
        acme.append({"name": "ppo-touch-red", "kind": "rl", "head": HEAD, "optimizer": {"lr": 1e-3},
                     "sft": {"dataset": "demos", "steps": 300, "batch_size": 64, "lr": 1e-3, "schedule": "cosine",
                             "warmup_steps": 100},
                     "rl": {"env": {**ENV, "options": {"reward": "dense"}}, "algorithm": "ppo", "mode": "sync",
                            "env_steps": rl_env_steps, "n_envs": 16, "sub_batches": 2, "segment_steps": 30,
                            "epochs": 4, "max_staleness": 8, "critic_warmup": 5, "lr": 3e-5},
                     "checkpoint_every": 20})
    bolt = [{"name": "flow-touch-red", "kind": "sft",
             "head": {"kind": "flow", "action_dim": 4, "horizon": 4, "state_dim": 8, "options": {"steps": 4}},
             "sft": {"dataset": "demos", "steps": steps // 2, "batch_size": 16}, "checkpoint_every": 50}]
    return {"acme": acme, "bolt": bolt}


def serve(data: Path):
    import uvicorn

    from vlamux.api.app import create_app
    from vlamux.api.host import ServiceConfig, ServiceHost

    host = ServiceHost(ServiceConfig(data_dir=data))
    admin = host.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(host), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, name="uvicorn", daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return host, server, admin, f"http://127.0.0.1:{port}"


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def shoot(driver, width: int, out: Path) -> None:
    """A full-page screenshot: the window grown to the page's height."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, height + 140)  # + the headless window's frame
    time.sleep(0.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.find_element("tag name", "body").screenshot(str(out))
    print(f"wrote {out}")


def wait_for(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    ap.add_argument("--admin-out", type=Path, default=Path("docs/img/dashboard-admin.png"))
    ap.add_argument("--steps", type=int, default=200, help="SFT steps of acme's job")
    ap.add_argument("--rl-env-steps", type=int, default=100_000, help="0: no RL job")
    ap.add_argument("--demos", type=int, default=50, help="demonstration episodes")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args()

    from vlamux.data.demos import generate

    data = Path(tempfile.mkdtemp(prefix="vlamux-dashboard-"))
    # DART demonstrations (the expert's motion noised, its actions kept), as the RL recipe's SFT start
    generate(["goal/touch-red-cube"], args.demos, data / "datasets" / "demos", image_size=32, workers=2, noise=0.5)
    host, server, admin, url = serve(data)
    try:
        keys, submitted = {}, {}
        for tenant, specs in jobs(args.steps, args.rl_env_steps).items():
            keys[tenant] = call(url, "POST", "/v1/tenants", admin, {"name": tenant})["api_key"]
            submitted[tenant] = [call(url, "POST", "/v1/jobs", keys[tenant], s)["job"]["id"] for s in specs]

        def all_done() -> bool:
            states = [call(url, "GET", f"/v1/jobs/{j}", keys[t])["job"]["state"]
                      for t, ids in submitted.items() for j in ids]
            print("jobs:", " ".join(states), flush=True)
            return all(s in ("succeeded", "failed", "cancelled") for s in states)

        wait_for("the jobs", all_done, timeout=3600)
        host.meter.tick()

        driver = browser(args.width, 900)
        try:
            driver.get(f"{url}/dashboard#key={keys['acme']}")
            focus = submitted["acme"][-1]  # the RL job, when there is one: both curves
            row = f'#jobs-table tbody tr[data-job-id="{focus}"]'
            wait_for("acme's jobs", lambda: driver.find_elements("css selector", row), 30)
            driver.find_element("css selector", row).click()
            wait_for("the curve", lambda: driver.find_element("css selector", "#curve-meta").text.endswith("final"), 30)
            time.sleep(2.5)  # one more poll, so "updated" is fresh
            shoot(driver, args.width, args.out)

            driver.set_window_size(args.width, 900)
            driver.get(f"{url}/dashboard#key={admin}")
            # a few polls, so the utilisation chart has a line
            wait_for("the utilisation chart",
                     lambda: int(driver.find_element("css selector", "#util-chart").get_attribute("data-points") or 0)
                     >= 15, 60)
            shoot(driver, args.width, args.admin_out)
        finally:
            driver.quit()
    finally:
        server.should_exit = True
        host.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
