/* vlamux dashboard: plain JS, no dependencies, nothing fetched but this service's own API.
 *
 * A tenant key shows the tenant's jobs (GET /v1/jobs, /v1/jobs/{id}), the selected job's learning
 * curves (GET /v1/jobs/{id}/metrics?since=N, appended every poll), its policies and usage. The admin
 * key shows the tenants, their usage and the services' utilisation, parsed from GET /metrics.
 */
"use strict";

(() => {
  const POLL_MS = 2000;
  const KEY_STORE = "vlamux.apiKey";
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const MAX_DETAIL_FETCHES = 10; // finished jobs' details fetched per poll (they are cached once read)
  const UTIL_HISTORY = 300; // samples kept for the utilisation chart (10 min at 2 s)
  const MAX_PATH_POINTS = 2000;
  const PALETTE = ["#2f6fde", "#e0752d", "#1f8f4e", "#8e44ad", "#c93a3a", "#16a3b5", "#7a8394"];
  const PHASE_COLORS = { sft: "#2f6fde", rl: "#e0752d" };

  const $ = (id) => document.getElementById(id);

  const state = {
    key: null,
    role: null, // "tenant" | "admin"
    tenantId: null,
    gen: 0, // bumped on every (re)connect; a stale poll sees a different value and stops
    timer: null,
    jobs: [],
    views: new Map(), // job id -> GET /v1/jobs/{id} answer
    selected: null,
    curve: null, // {jobId, next, rows, final}
    util: [], // [{t, values: {service: utilisation}}]
    utilT0: null,
  };

  // ---- API ------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, type, message, retryAfter) {
      super(message);
      this.status = status;
      this.type = type;
      this.retryAfter = retryAfter;
    }
  }

  async function api(path, { text = false } = {}) {
    const res = await fetch(path, {
      headers: { Authorization: `Bearer ${state.key}` },
      cache: "no-store",
    });
    if (!res.ok) {
      let type = "error";
      let message = res.statusText || "request failed";
      try {
        const body = await res.json();
        if (body && body.error) ({ type, message } = body.error);
      } catch (_) { /* not JSON */ }
      throw new ApiError(res.status, type, message, Number(res.headers.get("Retry-After")) || 0);
    }
    return text ? res.text() : res.json();
  }

  function describe(err) {
    if (err instanceof ApiError) {
      if (err.status === 401) {
        return `This API key was not accepted (401 ${err.type}: ${err.message}). Check the key; it may have ` +
          "been revoked, or its tenant disabled.";
      }
      if (err.status === 403) return `This key may not do that (403 ${err.type}: ${err.message}).`;
      if (err.status === 429) return `The service asks to slow down (429 ${err.type}: ${err.message}).`;
      return `${err.status} ${err.type}: ${err.message}`;
    }
    return `Cannot reach the service (${err && err.message ? err.message : err}).`;
  }

  // ---- small helpers --------------------------------------------------------------------------
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else if (k === "title") node.title = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const SVG_NS = "http://www.w3.org/2000/svg";
  function svgEl(tag, attrs = {}, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  const clamp01 = (x) => Math.min(1, Math.max(0, x));
  const DASH = "—";

  function fmtNum(x, sig = 4) {
    if (!isNum(x)) return DASH;
    if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
    if (x === 0) return "0";
    return String(Number(x.toPrecision(sig)));
  }
  function fmtInt(x) { return isNum(x) ? Math.round(x).toLocaleString("en-US") : DASH; }
  function fmtPct(x, digits = 1) { return isNum(x) ? `${(100 * x).toFixed(digits)} %` : DASH; }
  function fmtSeconds(s) {
    if (!isNum(s)) return DASH;
    if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }
  function fmtBytes(b) {
    if (!isNum(b)) return DASH;
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (b >= 1000 && i < units.length - 1) { b /= 1000; i += 1; }
    return `${i === 0 ? b : b.toFixed(1)} ${units[i]}`;
  }
  function fmtTime(epochS) {
    if (!isNum(epochS)) return DASH;
    const d = new Date(epochS * 1000);
    const today = new Date();
    const time = d.toLocaleTimeString("en-GB");
    return d.toDateString() === today.toDateString() ? time : `${d.toISOString().slice(0, 10)} ${time}`;
  }

  function showBanner(id, text) {
    const node = $(id);
    node.textContent = text || "";
    node.hidden = !text;
  }
  const showError = (t) => showBanner("error", t);
  const showNotice = (t) => showBanner("notice", t);

  // ---- charts ---------------------------------------------------------------------------------
  function niceScale(lo, hi, n) {
    if (lo === hi) {
      const d = Math.abs(lo) * 0.1 || 1;
      lo -= d;
      hi += d;
    }
    const raw = (hi - lo) / n;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const norm = raw / mag;
    const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
    const start = Math.floor(lo / step + 1e-9) * step;
    const end = Math.ceil(hi / step - 1e-9) * step;
    const ticks = [];
    for (let v = start; v <= end + step * 1e-6; v += step) ticks.push(Number(v.toFixed(12)));
    return { lo: start, hi: end, step, ticks };
  }

  function tickLabel(v, step, fmt) {
    if (fmt) return fmt(v);
    if (Math.abs(v) >= 10000 && step >= 1000) return `${Number((v / 1000).toFixed(1))}k`;
    const decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    return v.toFixed(decimals);
  }

  /** Exponential moving average (debiased) of a curve's y values, as TensorBoard smooths. */
  function smooth(points, weight) {
    let avg = 0;
    let norm = 0;
    return points.map(([x, y]) => {
      avg = weight * avg + (1 - weight) * y;
      norm = weight * norm + (1 - weight);
      return [x, avg / norm];
    });
  }

  /**
   * Draws a line chart into an <svg> with a viewBox.
   * opts: {series: [{name, color, points: [[x, y], ...]}], xLabel, yLabel, yDomain?: [lo, hi],
   *        yFmt?, xFmt?, empty: "text when there are no points", smoothAbove?: n}
   * Sets data-points (points drawn) and data-series (series with points) on the svg.
   */
  const charts = new Map(); // svg -> the options it was last drawn with (redrawn on resize)

  function drawChart(svg, opts) {
    charts.set(svg, opts);
    // One unit of the viewBox = one CSS pixel at the svg's current width: text keeps its size.
    const [, , W0, H] = svg.getAttribute("viewBox").split(/\s+/).map(Number);
    const W = Math.round(svg.clientWidth) || W0;
    if (W !== W0) svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const m = { l: 56, r: 14, t: 22, b: 40 };
    const pw = W - m.l - m.r;
    const ph = H - m.t - m.b;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const series = opts.series.filter((s) => s.points.length > 0);
    const total = series.reduce((n, s) => n + s.points.length, 0);
    svg.setAttribute("data-points", String(total));
    svg.setAttribute("data-series", String(series.length));
    if (total === 0) {
      svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty-text" },
        opts.empty || "no data yet"));
      return;
    }
    let xMin = Infinity;
    let xMax = -Infinity;
    let yMin = Infinity;
    let yMax = -Infinity;
    for (const s of series) {
      for (const [x, y] of s.points) {
        if (x < xMin) xMin = x;
        if (x > xMax) xMax = x;
        if (y < yMin) yMin = y;
        if (y > yMax) yMax = y;
      }
    }
    const xs_ = niceScale(xMin, xMax === xMin ? xMin + 1 : xMax, 6);
    const ys_ = opts.yDomain ? niceScale(opts.yDomain[0], opts.yDomain[1], 4)
      : niceScale(yMin, yMax, 4);
    // keep the x axis tight to the data (nice ticks inside it), the y axis on nice bounds
    const x0 = xMin;
    const x1 = xMax === xMin ? xMin + 1 : xMax;
    const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
    const sy = (y) => m.t + (1 - (y - ys_.lo) / (ys_.hi - ys_.lo)) * ph;

    for (const v of ys_.ticks) {
      const y = sy(v);
      svg.append(svgEl("line", { x1: m.l, x2: m.l + pw, y1: y, y2: y, class: "grid" }));
      svg.append(svgEl("text", { x: m.l - 6, y: y + 4, "text-anchor": "end", class: "tick" },
        tickLabel(v, ys_.step, opts.yFmt)));
    }
    for (const v of xs_.ticks) {
      if (v < x0 - 1e-9 || v > x1 + 1e-9) continue;
      const x = sx(v);
      svg.append(svgEl("line", { x1: x, x2: x, y1: m.t, y2: m.t + ph, class: "grid" }));
      svg.append(svgEl("text", { x, y: m.t + ph + 16, "text-anchor": "middle", class: "tick" },
        tickLabel(v, xs_.step, opts.xFmt)));
    }
    svg.append(svgEl("line", { x1: m.l, x2: m.l + pw, y1: m.t + ph, y2: m.t + ph, class: "axis" }));
    svg.append(svgEl("line", { x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph, class: "axis" }));
    svg.append(svgEl("text", { x: m.l + pw / 2, y: H - 6, "text-anchor": "middle", class: "axis-label" },
      opts.xLabel));
    svg.append(svgEl("text", {
      x: 12, y: m.t + ph / 2, "text-anchor": "middle", class: "axis-label",
      transform: `rotate(-90 12 ${m.t + ph / 2})`,
    }, opts.yLabel));

    const path = (all) => {
      const stride = Math.ceil(all.length / MAX_PATH_POINTS); // a path of a few thousand points at most
      const pts = stride > 1 ? all.filter((_, i) => i % stride === 0 || i === all.length - 1) : all;
      return pts.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
    };
    const drawn = [];
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      let line = s.points;
      if (opts.smoothAbove && s.points.length > opts.smoothAbove) {
        svg.append(svgEl("path", { d: path(s.points), class: "series-raw", stroke: color }));
        line = smooth(s.points, 0.8);
      }
      svg.append(svgEl("path", { d: path(line), class: "series", stroke: color, "data-name": s.name }));
      const [lx, ly] = line[line.length - 1];
      svg.append(svgEl("circle", { cx: sx(lx), cy: sy(ly), r: 3, fill: color }));
      drawn.push({ s, color });
    });
    if (series.length > 1 || opts.legend) {
      let x = m.l + pw;
      for (const { s, color } of drawn.slice().reverse()) {
        const label = svgEl("text", { x, y: 14, "text-anchor": "end", class: "legend" }, s.name);
        svg.append(label);
        const w = label.getComputedTextLength() || 6.5 * s.name.length;
        svg.append(svgEl("rect", { x: x - w - 14, y: 5, width: 10, height: 10, rx: 2, fill: color }));
        x -= w + 30;
      }
    }

    // hover read-out: the nearest point of each series at the cursor's x
    const cursor = svgEl("line", { y1: m.t, y2: m.t + ph, class: "cursor", visibility: "hidden" });
    const box = svgEl("rect", {
      class: "readout-bg", rx: 3, visibility: "hidden", height: 16 + 14 * (series.length - 1),
    });
    const texts = series.map(() => svgEl("text", { class: "readout", visibility: "hidden" }));
    svg.append(cursor, box, ...texts);
    const overlay = svgEl("rect", { x: m.l, y: m.t, width: pw, height: ph, fill: "transparent" });
    svg.append(overlay);
    overlay.addEventListener("mousemove", (ev) => {
      const r = svg.getBoundingClientRect();
      const vx = ((ev.clientX - r.left) / r.width) * W;
      const x = x0 + ((vx - m.l) / pw) * (x1 - x0);
      let widest = 0;
      series.forEach((s, i) => {
        let best = s.points[0];
        for (const p of s.points) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
        const label = `${series.length > 1 ? `${s.name}: ` : ""}${opts.xLabel} ${fmtNum(best[0])}, ` +
          `${opts.yLabel} ${opts.yFmt ? opts.yFmt(best[1]) : fmtNum(best[1])}`;
        texts[i].textContent = label;
        widest = Math.max(widest, label.length * 6.2);
      });
      const bx = vx + widest + 16 > W ? vx - widest - 12 : vx + 8;
      cursor.setAttribute("x1", vx);
      cursor.setAttribute("x2", vx);
      box.setAttribute("x", bx - 4);
      box.setAttribute("y", m.t + 2);
      box.setAttribute("width", widest + 8);
      texts.forEach((t, i) => {
        t.setAttribute("x", bx);
        t.setAttribute("y", m.t + 14 + 14 * i);
      });
      for (const n of [cursor, box, ...texts]) n.setAttribute("visibility", "visible");
    });
    overlay.addEventListener("mouseleave", () => {
      for (const n of [cursor, box, ...texts]) n.setAttribute("visibility", "hidden");
    });
  }

  // ---- connect / poll -------------------------------------------------------------------------
  function stop() {
    state.gen += 1;
    if (state.timer) clearTimeout(state.timer);
    state.timer = null;
  }

  function resetView() {
    state.role = null;
    state.tenantId = null;
    state.jobs = [];
    state.views = new Map();
    state.selected = null;
    state.curve = null;
    state.util = [];
    state.utilT0 = null;
    $("tenant-view").hidden = true;
    $("admin-view").hidden = true;
    $("welcome").hidden = false;
    $("signout").hidden = true;
    $("who").textContent = "not connected";
    $("updated").textContent = DASH;
    showNotice(null);
  }

  function setWho() {
    const who = $("who");
    who.textContent = "";
    if (state.role === "admin") who.append("signed in as ", el("b", { text: "admin" }));
    else who.append("tenant ", el("b", { text: state.tenantId || "…" }));
  }

  function fail(err) {
    stop();
    resetView();
    state.key = null;
    sessionStorage.removeItem(KEY_STORE);
    showError(describe(err));
  }

  async function connect(key) {
    stop();
    resetView();
    const gen = state.gen;
    state.key = key;
    showError(null);
    $("who").textContent = "connecting…";
    let role;
    try {
      await api("/v1/tenants"); // only the admin may list tenants
      role = "admin";
    } catch (err) {
      if (gen !== state.gen) return;
      if (err instanceof ApiError && err.status === 403) role = "tenant";
      else {
        fail(err);
        return;
      }
    }
    if (gen !== state.gen) return;
    sessionStorage.setItem(KEY_STORE, key);
    state.role = role;
    $("welcome").hidden = true;
    $("signout").hidden = false;
    $(role === "admin" ? "admin-view" : "tenant-view").hidden = false;
    setWho();
    poll(gen);
  }

  async function poll(gen) {
    let delay = POLL_MS;
    if (!document.hidden) {
      try {
        if (state.role === "admin") await refreshAdmin(gen);
        else await refreshTenant(gen);
        if (gen !== state.gen) return;
        showNotice(null);
        $("updated").textContent = `updated ${new Date().toLocaleTimeString("en-GB")}`;
      } catch (err) {
        if (gen !== state.gen) return;
        if (err instanceof ApiError && err.status === 401) {
          fail(err);
          return;
        }
        if (err instanceof ApiError && err.status === 403) {
          showError(describe(err));
        } else {
          if (err instanceof ApiError && err.status === 429) delay = Math.max(delay, 1000 * err.retryAfter);
          showNotice(`${describe(err)} Retrying…`);
        }
        if (!(err instanceof ApiError)) console.error(err);
      }
    }
    if (gen === state.gen) state.timer = setTimeout(() => poll(gen), delay);
  }

  // ---- the tenant's view ----------------------------------------------------------------------
  async function refreshTenant(gen) {
    const [jobs, usage, policies, datasets] = await Promise.all([api("/v1/jobs"), api("/v1/usage"),
      api("/v1/policies"), api("/v1/datasets")]);
    if (gen !== state.gen) return;
    const list = jobs.jobs.slice().sort((a, b) => b.created_at - a.created_at);

    // Details (progress) for every job that can still change, and for finished ones not read yet.
    const live = list.filter((j) => {
      const v = state.views.get(j.id);
      return !v || v.state !== j.state || !TERMINAL.has(j.state);
    });
    const running = live.filter((j) => !TERMINAL.has(j.state));
    const finished = live.filter((j) => TERMINAL.has(j.state)).slice(0, MAX_DETAIL_FETCHES);
    const views = await Promise.all([...running, ...finished].map((j) =>
      api(`/v1/jobs/${encodeURIComponent(j.id)}`).then((r) => r.job).catch((err) => {
        if (err instanceof ApiError && err.status === 401) throw err;
        return null; // e.g. 404: deleted in between
      })));
    if (gen !== state.gen) return;
    for (const v of views) if (v) state.views.set(v.id, v);
    state.jobs = list;

    const entries = Object.entries(usage.usage || {});
    if (entries.length) state.tenantId = entries[0][0];
    setWho();
    renderUsage(entries.length ? entries[0][1] : {}, list);

    if (!state.selected || !list.some((j) => j.id === state.selected)) {
      const first = list.find((j) => j.state === "running") || list[0];
      state.selected = first ? first.id : null;
    }
    renderJobs(list);
    renderPolicies(policies.policies || []);
    renderDatasets(datasets.datasets || []);
    await refreshCurve(gen);
  }

  /** "2 active · 3 succeeded": the non-zero counts, in this order. */
  function countsText(counts, order) {
    const parts = order.filter((k) => counts[k]).map((k) => `${fmtInt(counts[k])} ${k}`);
    return parts.length ? parts.join(" · ") : "none yet";
  }

  function card(kind, label, value, sub) {
    return el("div", { class: "card", "data-kind": kind },
      el("div", { class: "label", text: label }),
      el("div", { class: "value", text: value }),
      sub ? el("div", { class: "sub", text: sub }) : null);
  }

  function renderUsage(u, jobs) {
    const counts = {};
    for (const j of jobs) counts[j.state] = (counts[j.state] || 0) + 1;
    counts.active = (counts.running || 0) + (counts.queued || 0);
    $("usage").replaceChildren(
      card("jobs", "Jobs", fmtInt(jobs.length), countsText(counts, ["active", "succeeded", "failed", "cancelled"])),
      card("backbone_s", "Backbone time", fmtSeconds(u.backbone_s), "shared, split by rows"),
      card("head_s", "Head time", fmtSeconds(u.head_s), "your heads' compute"),
      card("env_steps", "Env steps", fmtInt(u.env_steps), "simulator steps"),
      card("requests", "Inference requests", fmtInt(u.requests), "action chunks served"),
      card("stored_bytes", "Stored", fmtBytes(u.stored_bytes), "checkpoints on disk"),
    );
  }

  function progressOf(job, view) {
    const p = (view && view.progress) || {};
    let frac = null;
    let text = "";
    if (p.phase === "rl" && isNum(p.env_steps) && isNum(p.of) && p.of > 0) {
      frac = p.env_steps / p.of;
      text = `${fmtInt(p.env_steps)} / ${fmtInt(p.of)} env steps`;
    } else if (isNum(p.step) && isNum(p.of) && p.of > 0) {
      frac = p.step / p.of;
      text = `step ${fmtInt(p.step)} / ${fmtInt(p.of)}`;
    }
    if (job.state === "succeeded") frac = 1;
    if (frac === null) text = job.state === "queued" ? queuedText(job.queue) : job.state === "running" ? "starting" : "";
    return { frac: frac === null ? 0 : Math.max(0, Math.min(1, frac)), text, p };
  }

  // a job the service has no room for yet: its place and when it should start ("queued #2 of 3, ~14:05")
  function queuedText(q) {
    if (!q) return "waiting";
    const at = isNum(q.eta_at) ? `, ~${new Date(q.eta_at * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })}` : "";
    return `queued #${q.position} of ${q.of}${at}`;
  }

  function renderJobs(list) {
    const body = $("jobs-table").querySelector("tbody");
    $("jobs-empty").hidden = list.length > 0;
    $("jobs-table").hidden = list.length === 0;
    body.replaceChildren(...list.map((job) => {
      const view = state.views.get(job.id);
      const { frac, text, p } = progressOf(job, view);
      const barClass = job.state === "succeeded" ? "bar done" : job.state === "failed" ? "bar failed" : "bar";
      const bar = el("div", { class: barClass }, el("div", { style: `width:${(100 * frac).toFixed(1)}%` }));
      const row = el("tr", {
        class: `clickable${job.id === state.selected ? " selected" : ""}`, "data-job-id": job.id,
        title: `job ${job.id}`,
      },
      el("td", { class: "name" }, el("b", { text: job.name }), " ", el("span", { class: "mono", text: job.id })),
      el("td", { text: job.kind }),
      el("td", { class: "state" }, el("span", { class: `badge ${job.state}`, text: job.state })),
      el("td", { class: "phase", text: p.phase || DASH }),
      el("td", { class: "progress-cell" },
        el("div", { class: "progress" }, bar, el("span", { class: "pct", text: text || fmtPct(frac, 0) }))),
      el("td", { class: "num loss", text: fmtNum(p.loss) }),
      el("td", { class: "num", text: fmtPct(p.success_rate) }),
      el("td", { class: "num", text: fmtInt(p.policy_version) }),
      el("td", { text: fmtTime(job.created_at) }));
      row.addEventListener("click", () => selectJob(job.id));
      return row;
    }));
  }

  function selectJob(id) {
    if (state.selected === id) return;
    state.selected = id;
    state.curve = null;
    renderJobs(state.jobs);
    drawCurves();
    refreshCurve(state.gen).catch((err) => showNotice(describe(err)));
  }

  function renderDatasets(list) {
    $("datasets-empty").hidden = list.length > 0;
    $("datasets-table").hidden = list.length === 0;
    $("datasets-table").querySelector("tbody").replaceChildren(...list.map((d) =>
      el("tr", { "data-dataset": d.name },
        el("td", {}, el("b", { text: d.name })),
        el("td", { text: d.public ? "the service's (public)" : "yours (private)" }),
        el("td", { class: "num", text: d.public ? DASH : fmtBytes(d.bytes) }))));
  }

  function renderPolicies(list) {
    $("policies-empty").hidden = list.length > 0;
    $("policies-table").hidden = list.length === 0;
    $("policies-table").querySelector("tbody").replaceChildren(...list.map((p) => {
      const h = p.head || {};
      return el("tr", { "data-policy-id": p.id },
        el("td", {}, el("b", { text: p.name || p.id })),
        el("td", { class: "mono", text: p.id }),
        el("td", { text: p.source === "training_slot" ? "training slot" : p.source || DASH }),
        el("td", { text: h.kind ? `${h.kind}${h.state_dim ? ` · state ${h.state_dim}` : ""}` : DASH }),
        el("td", { class: "num", text: h.action_dim ? `${h.action_dim} × ${h.horizon}` : DASH }),
        el("td", { class: "num", text: p.policy_version === null ? "not loaded" : fmtInt(p.policy_version) }));
    }));
  }

  // ---- learning curves ------------------------------------------------------------------------
  async function refreshCurve(gen) {
    const id = state.selected;
    if (!id) {
      $("curve-panel").hidden = true;
      return;
    }
    let c = state.curve;
    if (!c || c.jobId !== id) {
      c = { jobId: id, next: 0, rows: [], final: false, streaming: false, lastEvent: 0 };
      state.curve = c;
      const job = state.jobs.find((j) => j.id === id);
      if (job && !TERMINAL.has(job.state)) streamCurve(c); // live: pushed as it happens
    }
    if (!c.final && !c.streaming) { // a finished job, or a server without event streams: poll
      const job = state.jobs.find((j) => j.id === id);
      const finished = job && TERMINAL.has(job.state); // read after the job ended: nothing more will come
      const r = await api(`/v1/jobs/${encodeURIComponent(id)}/metrics?since=${c.next}`);
      if (gen !== state.gen || state.curve !== c) return;
      for (const row of r.rows) c.rows.push(row);
      c.next = r.next;
      if (finished) c.final = true;
    }
    drawCurves();
  }

  // The selected live job's metric rows as they happen, from its Server-Sent Events (read with fetch:
  // an EventSource cannot send the key). Reconnects with Last-Event-ID after the server's idle end;
  // on any failure refreshCurve polls again from the rows already drawn.
  async function streamCurve(c) {
    c.streaming = true;
    try {
      while (!c.final && state.curve === c) {
        const res = await fetch(`/v1/jobs/${encodeURIComponent(c.jobId)}/events`, {
          headers: { Authorization: `Bearer ${state.key}`, "Last-Event-ID": String(c.lastEvent) },
          cache: "no-store",
        });
        if (!res.ok || !res.body) return;
        const reader = res.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const ev = {};
            for (const line of buf.slice(0, cut).split("\n")) {
              const k = line.indexOf(":");
              if (k > 0) ev[line.slice(0, k)] = line.slice(k + 1).replace(/^ /, "");
            }
            buf = buf.slice(cut + 2);
            if (!ev.data) continue;
            if (ev.id) c.lastEvent = Number(ev.id);
            const body = JSON.parse(ev.data);
            if (ev.event === "progress") {
              c.rows.push(body.data);
              c.next = c.rows.length; // progress events are the metric rows, in order
            } else if (ev.event === "end") {
              c.final = true;
            }
          }
          if (state.curve !== c) {
            reader.cancel();
            return;
          }
          drawCurves();
        }
      }
    } catch (err) {
      console.warn("job event stream ended; polling instead", err);
    } finally {
      c.streaming = false;
    }
  }

  function drawCurves() {
    const c = state.curve;
    const id = state.selected;
    $("curve-panel").hidden = !id;
    if (!id) return;
    const job = state.jobs.find((j) => j.id === id) || { id, name: id, kind: "", state: "" };
    const view = state.views.get(id);
    const rows = c && c.jobId === id ? c.rows : [];

    $("curve-title").textContent = `Learning curve · ${job.name}`;
    $("curve-meta").textContent = `${job.kind} job ${job.id} · ${fmtInt(rows.length)} metric rows` +
      (c && c.final ? " · final" : " · live");

    // Each phase counts its steps from 1 (an RL job's SFT warm start, then RL): the phases are laid
    // out one after another on the step axis, a colour each.
    const byPhase = new Map();
    let offset = 0;
    let last = 0;
    let phase = null;
    for (const r of rows) {
      if (!isNum(r.loss) || !isNum(r.step)) continue;
      const ph = r.phase || "train";
      if (ph !== phase) {
        if (phase !== null && !byPhase.has(ph)) offset = last;
        phase = ph;
      }
      if (!byPhase.has(ph)) byPhase.set(ph, []);
      last = offset + r.step;
      byPhase.get(ph).push([last, r.loss]);
    }
    drawChart($("loss-chart"), {
      series: [...byPhase].map(([name, points]) => ({ name, points, color: PHASE_COLORS[name] })),
      xLabel: "step", yLabel: "loss", smoothAbove: 40,
      empty: job.state === "queued" ? "waiting for the job to start…" : "waiting for the first step…",
    });
    const success = rows.filter((r) => isNum(r.success_rate) && isNum(r.env_steps))
      .map((r) => [r.env_steps, r.success_rate]);
    drawChart($("success-chart"), {
      series: [{ name: "success rate", points: success, color: PHASE_COLORS.rl }],
      xLabel: "env steps", yLabel: "success", yDomain: [0, 1],
      yFmt: (v) => `${Math.round(v * 100)} %`,
      empty: job.kind === "sft" ? "an SFT job takes no environment steps" : "waiting for the first rollouts…",
    });
    renderJobDetail(job, view);
  }

  function renderJobDetail(job, view) {
    const box = $("job-detail");
    box.replaceChildren();
    if (!view) return;
    const events = (view.events || []).filter((e, i, a) => i === 0 || e.state !== a[i - 1].state);
    box.append(el("div", {},
      "events: ", events.map((e) => `${e.state} ${fmtTime(e.at)}${e.detail ? ` (${e.detail})` : ""}`).join(" → ")));
    const res = view.result || {};
    const facts = [];
    if (res.sft && isNum(res.sft.final_loss)) facts.push(`final SFT loss ${fmtNum(res.sft.final_loss)}`);
    for (const when of ["before", "after_sft", "after"]) {
      const e = res[when];
      const s = e && (isNum(e.success) ? e.success : e.success && e.success.rate);
      if (isNum(s)) facts.push(`success ${when.replace("_", " ")} ${fmtPct(s)}`);
    }
    if (isNum(res.wall_s)) facts.push(`wall time ${fmtSeconds(res.wall_s)}`);
    if (isNum(res.policy_version)) facts.push(`policy version ${res.policy_version}`);
    if (facts.length) box.append(el("div", {}, `result: ${facts.join(" · ")}`));
    if (view.error) box.append(el("div", { class: "err" }, `error: ${view.error}`));
  }

  // ---- the admin's view -----------------------------------------------------------------------
  /** Prometheus text format -> [{name, labels, value}]. */
  function parseProm(text) {
    const out = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = line.match(/^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      const re = /(\w+)="((?:[^"\\]|\\.)*)"/g;
      let l;
      while ((l = re.exec(m[2] || "")) !== null) {
        labels[l[1]] = l[2].replace(/\\(.)/g, (_, ch) => (ch === "n" ? "\n" : ch));
      }
      out.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return out;
  }

  // replicas that page their serving slots (vlamux serve --slot-memory-mb): resident, parked, stored
  function slotCards(series) {
    if (!series.length) return [];
    const sum = (tier, what) => series.filter((s) => s.labels.tier === tier && s.labels.what === what)
      .reduce((n, s) => n + s.value, 0);
    return [card("slots", "Serving slots", fmtInt(sum("resident", "count")),
      `resident (${fmtBytes(sum("resident", "bytes"))}); ${fmtInt(sum("parked", "count"))} parked, ` +
      `${fmtInt(sum("stored", "count"))} stored`)];
  }

  async function refreshAdmin(gen) {
    const [tenants, usage, text, health] = await Promise.all([
      api("/v1/tenants"), api("/v1/usage"), api("/metrics", { text: true }),
      fetch("/healthz", { cache: "no-store" }).then((r) => r.json()).catch(() => null),
    ]);
    if (gen !== state.gen) return;
    const samples = parseProm(text);
    const pick = (name) => samples.filter((s) => s.name === name);

    const jobsBy = Object.fromEntries(pick("vlamux_jobs").map((s) => [s.labels.state, s.value]));
    const finished = (jobsBy.succeeded || 0) + (jobsBy.failed || 0) + (jobsBy.cancelled || 0);
    const depth = pick("vlamux_queue_depth").reduce((n, s) => n + s.value, 0);
    const sessions = pick("vlamux_env_sessions").reduce((n, s) => n + s.value, 0);
    const list = tenants.tenants || [];
    const disabled = list.filter((t) => t.disabled).length;
    $("admin-cards").replaceChildren(
      card("tenants", "Tenants", fmtInt(list.length), `${disabled} disabled`),
      card("jobs_running", "Jobs running", fmtInt(jobsBy.running), `${fmtInt(jobsBy.queued)} queued`),
      card("jobs_done", "Jobs finished", fmtInt(finished), countsText(jobsBy, ["succeeded", "failed", "cancelled"])),
      card("env_sessions", "Env sessions", fmtInt(sessions), "open simulator sessions"),
      card("queue_depth", "Queued requests", fmtInt(depth), "in the model queues"),
      card("uptime", "Uptime", fmtSeconds(health && health.uptime_s), "this server process"),
      ...slotCards(pick("vlamux_slot_tier")),
    );

    const util = pick("vlamux_service_utilization");
    $("util").replaceChildren(...util.map((s) => el("div", { class: "util-row", "data-service": s.labels.service },
      el("span", { class: "name", text: s.labels.service }),
      el("div", { class: "bar" }, el("div", { style: `width:${(100 * clamp01(s.value)).toFixed(1)}%` })),
      el("span", { class: "pct", text: fmtPct(s.value) }))));
    if (!util.length) $("util").append(el("p", { class: "empty", text: "no utilisation figures in /metrics" }));

    const now = Date.now() / 1000;
    if (state.utilT0 === null) state.utilT0 = now;
    const values = Object.fromEntries(util.map((s) => [s.labels.service, s.value]));
    state.util.push({ t: now - state.utilT0, values });
    if (state.util.length > UTIL_HISTORY) state.util.shift();
    const services = [...new Set(state.util.flatMap((u) => Object.keys(u.values)))];
    drawChart($("util-chart"), {
      series: services.map((name) => ({
        name, points: state.util.filter((u) => name in u.values).map((u) => [u.t, u.values[name]]),
      })),
      xLabel: "seconds", yLabel: "utilisation", yDomain: [0, 1], legend: true,
      yFmt: (v) => `${Math.round(v * 100)} %`, xFmt: (v) => `${Math.round(v)}`,
    });

    const queues = new Map();
    const q = (s) => {
      const k = `${s.labels.queue}|${s.labels.service}`;
      if (!queues.has(k)) queues.set(k, { queue: s.labels.queue, service: s.labels.service });
      return queues.get(k);
    };
    for (const s of pick("vlamux_queue_depth")) q(s).depth = s.value;
    for (const s of pick("vlamux_queue_wait_seconds")) q(s)[`p${s.labels.quantile}`] = s.value;
    for (const s of pick("vlamux_group_rows_mean")) q(s).rows = s.value;
    for (const s of pick("vlamux_group_requests_mean")) q(s).reqs = s.value;
    for (const s of pick("vlamux_groups_total").concat(pick("vlamux_groups"))) q(s).groups = s.value;
    $("queues-table").querySelector("tbody").replaceChildren(...[...queues.values()].map((r) => el("tr", {},
      el("td", { text: r.queue }), el("td", { text: r.service }),
      el("td", { class: "num", text: fmtInt(r.depth) }),
      el("td", { class: "num", text: fmtSeconds(r["p0.5"]) }),
      el("td", { class: "num", text: fmtSeconds(r["p0.99"]) }),
      el("td", { class: "num", text: fmtNum(r.rows, 3) }),
      el("td", { class: "num", text: fmtNum(r.reqs, 3) }),
      el("td", { class: "num", text: fmtInt(r.groups) }))));

    const use = usage.usage || {};
    $("tenants-empty").hidden = list.length > 0;
    $("tenants-table").hidden = list.length === 0;
    $("tenants-table").querySelector("tbody").replaceChildren(...list.map((t) => {
      const u = use[t.id] || {};
      const qt = t.quotas || {};
      return el("tr", { "data-tenant-id": t.id },
        el("td", { class: "name" }, el("b", { text: t.name })),
        el("td", { class: "mono", text: t.id }),
        el("td", {}, el("span", {
          class: `badge ${t.disabled ? "disabled" : "enabled"}`, text: t.disabled ? "disabled" : "active",
        })),
        el("td", { class: "num", text: fmtInt(qt.max_concurrent_jobs) }),
        el("td", { class: "num", text: fmtInt(qt.max_env_sessions) }),
        el("td", { class: "num", text: fmtNum(qt.requests_per_s) }),
        el("td", { class: "num", "data-kind": "backbone_s", text: fmtSeconds(u.backbone_s) }),
        el("td", { class: "num", "data-kind": "head_s", text: fmtSeconds(u.head_s) }),
        el("td", { class: "num", "data-kind": "env_steps", text: fmtInt(u.env_steps) }),
        el("td", { class: "num", "data-kind": "requests", text: fmtInt(u.requests) }),
        el("td", { class: "num", "data-kind": "stored_bytes", text: fmtBytes(u.stored_bytes) }));
    }));
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const [svg, opts] of charts) if (svg.isConnected && svg.clientWidth) drawChart(svg, opts);
    }, 150);
  });

  // ---- start ----------------------------------------------------------------------------------
  /** A key in the URL fragment (#key=vmx_...): taken, then removed from the address bar. */
  function keyFromHash() {
    const m = window.location.hash.match(/^#(?:.*&)?key=([^&]+)/);
    if (!m) return null;
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
    return decodeURIComponent(m[1]);
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    $("key-input").value = "";
    if (key) connect(key);
  });
  $("signout").addEventListener("click", () => {
    stop();
    state.key = null;
    sessionStorage.removeItem(KEY_STORE);
    showError(null);
    resetView();
  });
  window.addEventListener("hashchange", () => {
    const key = keyFromHash();
    if (key) connect(key);
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && state.role) {
      stop();
      poll(state.gen);
    }
  });

  const initial = keyFromHash() || sessionStorage.getItem(KEY_STORE);
  if (initial) connect(initial);
})();
