// pyserve status page: polls status/json and fills the table in place.
// Every name, reason and message goes into the page with textContent (never as HTML).
"use strict";

(function () {
  const POLL_MS = 2000;
  const COLUMNS = ["name", "version", "state", "backend", "instances", "batching", "rate", "p50", "p90", "p99",
    "queue", "totals", "actions"];
  const NUMERIC = new Set(["rate", "p50", "p90", "p99", "queue", "totals"]);
  const rows = new Map(); // "name\u0000version" -> <tr>
  const tbody = document.querySelector("#models tbody");
  const filterInput = document.getElementById("filter");
  let lastData = null;
  let busy = false;

  const query = new URLSearchParams(window.location.search);
  if (query.has("model")) {
    filterInput.value = query.get("model");
  }
  filterInput.addEventListener("input", function () {
    if (lastData) render(lastData);
  });

  function text(element, value) {
    const shown = value === null || value === undefined ? "" : String(value);
    if (element.textContent !== shown) element.textContent = shown;
  }

  function show(id, message) {
    const element = document.getElementById(id);
    text(element, message || "");
    element.hidden = !message;
  }

  function milliseconds(value) {
    if (value === null || value === undefined) return "\u2014";
    if (value < 1) return (value * 1000).toFixed(value < 0.01 ? 1 : 0) + " \u00b5s";
    if (value < 10) return value.toFixed(2) + " ms";
    if (value < 1000) return value.toFixed(1) + " ms";
    return (value / 1000).toFixed(2) + " s";
  }

  function rate(value) {
    if (value === null || value === undefined) return "\u2014";
    return value < 10 ? value.toFixed(2) : value.toFixed(1);
  }

  function instances(model) {
    const groups = model.instance_groups;
    if (!groups) return "";
    const parts = groups.map(function (g) {
      const gpus = g.kind === "GPU" && g.gpus.length ? " [GPU " + g.gpus.join(",") + "]" : "";
      return g.count + " \u00d7 " + g.kind + gpus;
    });
    let shown = parts.join(", ");
    if (model.instances !== null && model.instances !== undefined) shown += " (" + model.instances + " running)";
    return shown;
  }

  function batching(model) {
    const b = model.batching;
    if (!b) return "";
    const parts = [];
    parts.push(b.max_batch_size > 0 ? "max " + b.max_batch_size : "no batching");
    if (b.scheduler === "dynamic") {
      let dynamic = "dynamic";
      if (b.preferred_batch_size.length) dynamic += ", preferred " + b.preferred_batch_size.join("/");
      if (b.max_queue_delay_us) dynamic += ", delay " + b.max_queue_delay_us + " \u00b5s";
      parts.push(dynamic);
    } else if (b.scheduler === "sequence") {
      parts.push("sequence (" + b.strategy + ")");
    } else if (b.scheduler === "ensemble") {
      parts.push("ensemble");
    }
    if (b.decoupled) parts.push("decoupled");
    return parts.join("; ");
  }

  function reasonCell(cell, state, reason) {
    // the state, and a failure reason under it: its first line, the rest folded
    let badge = cell.querySelector(".badge");
    if (!badge) {
      badge = document.createElement("span");
      cell.appendChild(badge);
    }
    text(badge, state || "not loaded");
    badge.className = "badge state-" + (state || "none").toLowerCase();
    let details = cell.querySelector("details");
    if (!reason) {
      if (details) details.remove();
      return;
    }
    if (!details) {
      details = document.createElement("details");
      details.className = "reason";
      const summary = document.createElement("summary");
      const full = document.createElement("pre");
      details.appendChild(summary);
      details.appendChild(full);
      cell.appendChild(details);
    }
    // the first line says where it failed, the last one (of a traceback) what went wrong
    const lines = reason.split("\n").map(function (l) { return l.trim(); }).filter(Boolean);
    let brief = lines[0] || "";
    if (lines.length > 1) brief += " \u2026 " + lines[lines.length - 1];
    text(details.querySelector("summary"), brief.length > 240 ? brief.slice(0, 239) + "\u2026" : brief);
    text(details.querySelector("pre"), reason);
  }

  function control(name, action) {
    const path = "v2/repository/models/" + encodeURIComponent(name) + "/" + action;
    show("message", (action === "load" ? "Loading " : "Unloading ") + name + "\u2026");
    fetch(path, { method: "POST", headers: { "content-type": "application/json" }, body: "{}" })
      .then(function (response) {
        if (response.ok) {
          show("message", name + ": " + (action === "load" ? "loaded" : "unloaded"));
          return null;
        }
        return response.json().then(function (body) {
          show("message", name + ": " + action + " failed: " + (body && body.error ? body.error : response.status));
        }, function () {
          show("message", name + ": " + action + " failed: HTTP " + response.status);
        });
      }, function (error) {
        show("message", name + ": " + action + " failed: " + error);
      })
      .then(poll);
  }

  function actionsCell(cell, model, enabled) {
    const wanted = !enabled ? "" : (model.state === "READY" ? "unload" : "load");
    const button = cell.querySelector("button");
    if (button && button.dataset.action === wanted) return;
    if (button) button.remove();
    if (!wanted) return;
    const made = document.createElement("button");
    made.type = "button";
    made.dataset.action = wanted;
    made.className = wanted;
    text(made, wanted === "load" ? "Load" : "Unload");
    made.addEventListener("click", function () { control(model.name, wanted); });
    cell.appendChild(made);
  }

  function row(model) {
    const key = model.name + "\u0000" + (model.version === null ? "" : model.version);
    let tr = rows.get(key);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.model = model.name;
      tr.dataset.version = model.version === null ? "" : model.version;
      COLUMNS.forEach(function (column) {
        const td = document.createElement("td");
        td.dataset.column = column;
        td.className = NUMERIC.has(column) ? column + " num" : column;
        tr.appendChild(td);
      });
      rows.set(key, tr);
    }
    return [key, tr];
  }

  function fill(tr, model, controlEnabled) {
    const cells = {};
    tr.querySelectorAll("td").forEach(function (td) { cells[td.dataset.column] = td; });
    text(cells.name, model.name);
    text(cells.version, model.version === null ? "\u2014" : model.version);
    reasonCell(cells.state, model.state, model.reason);
    text(cells.backend, model.backend ? model.backend + (model.platform ? " (" + model.platform + ")" : "") : "");
    text(cells.instances, instances(model));
    text(cells.batching, batching(model));
    const stats = model.stats;
    const recent = stats ? stats.recent : null;
    text(cells.rate, stats ? rate(recent ? recent.requests_per_s : null) : "");
    text(cells.p50, stats ? milliseconds(recent ? recent.p50_ms : null) : "");
    text(cells.p90, stats ? milliseconds(recent ? recent.p90_ms : null) : "");
    text(cells.p99, stats ? milliseconds(recent ? recent.p99_ms : null) : "");
    text(cells.queue, stats ? milliseconds(recent ? recent.queue_ms : null) : "");
    text(cells.totals, stats ? stats.success + " / " + stats.failure : "");
    actionsCell(cells.actions, model, controlEnabled);
  }

  function render(data) {
    lastData = data;
    const server = data.server || {};
    text(document.getElementById("server"), [server.name, server.version].filter(Boolean).join(" "));
    const health = document.getElementById("health");
    if (server.ready === undefined) {
      text(health, "");
      health.hidden = true;
    } else {
      health.hidden = false;
      text(health, server.ready ? "ready" : (server.live ? "live, not ready" : "not live"));
      health.className = "badge " + (server.ready ? "state-ready" : "state-unavailable");
    }
    text(document.getElementById("updated"), "updated " + new Date().toLocaleTimeString() +
      " \u00b7 model control: " + data.control.mode);
    const refused = Object.keys(data.restricted || {});
    show("restricted", refused.length ? "Restricted here (--http-restricted-api): " + refused.map(function (c) {
      return c + " (" + data.restricted[c] + ")";
    }).join("; ") : "");
    const models = data.models || [];
    const needle = filterInput.value.trim().toLowerCase();
    const shown = models.filter(function (m) { return !needle || m.name.toLowerCase().includes(needle); });
    const keep = new Set();
    shown.forEach(function (model) {
      const made = row(model);
      keep.add(made[0]);
      fill(made[1], model, data.control.enabled);
      tbody.appendChild(made[1]); // in the server's order
    });
    rows.forEach(function (tr, key) {
      if (!keep.has(key)) {
        tr.remove();
        if (!models.some(function (m) { return m.name + "\u0000" + (m.version === null ? "" : m.version) === key; })) {
          rows.delete(key);
        }
      }
    });
    const ready = models.filter(function (m) { return m.state === "READY"; }).length;
    text(document.getElementById("summary"), models.length + " model versions, " + ready + " ready");
    let empty = "";
    if (data.models === null) empty = "The model list is restricted on this server.";
    else if (!models.length) empty = "No models in the repository.";
    else if (!shown.length) empty = "No model matches \u201c" + filterInput.value + "\u201d.";
    show("empty", empty);
  }

  function poll() {
    if (busy) return;
    busy = true;
    fetch("status/json", { cache: "no-store", headers: { accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) {
        show("error", "");
        render(data);
      }, function (error) {
        show("error", "The server did not answer: " + error.message + " (retrying)");
      })
      .then(function () { busy = false; });
  }

  poll();
  window.setInterval(poll, POLL_MS);
})();
