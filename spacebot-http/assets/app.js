// The spacebot dashboard: the organization's graph, live activity from the event stream, task
// boards, link timelines, shared notes and a chat box. Talks only to the public API of spacebot-http.
(function () {
  "use strict";

  const $ = (sel) => document.querySelector(sel);
  const state = { agents: [], links: [], cy: null, source: null, working: new Map(), steps: new Map(), answered: new Set(), editing: null, followRequest: null,
    notes: [], note: null, noteVersion: null, noteHistory: [], notesSeq: 0 };

  // The token: from the URL fragment (#token=...), kept for this tab only.
  (function readToken() {
    const match = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
    if (match) {
      sessionStorage.setItem("spacebot-token", decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  })();
  const token = () => sessionStorage.getItem("spacebot-token") || "";

  function showError(text) { $("#error").textContent = text || ""; }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (token()) headers.Authorization = "Bearer " + token();
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    if (response.status === 401) {
      $("#token-form").hidden = false;
      throw new Error("a token is needed");
    }
    const text = await response.text();
    const data = text ? (response.headers.get("content-type") || "").includes("json") ? JSON.parse(text) : text : null;
    if (!response.ok) {
      const e = data && data.error ? data.error : { message: response.statusText };
      const error = new Error(e.message + (e.field ? " (" + e.field + ")" : ""));
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fillSelect(select, options, keep) {
    const previous = keep ? select.value : "";
    select.replaceChildren(...options.map(([value, label]) => {
      const o = el("option", "", label);
      o.value = value;
      return o;
    }));
    if (previous && options.some(([v]) => v === previous)) select.value = previous;
  }

  // ---- topology editor ----
  // One table of colours for the edges and the legend, so the two always agree.
  const COLOURS = { superior: "#2f6fdb", subordinate: "#8a4fd3", peer: "#1f9d6b", disabled: "#9aa0ad", hot: "#f08c00" };

  function edgeClasses(link) {
    return [link.relationship, link.direction, link.enabled ? "enabled" : "disabled"].join(" ");
  }

  // Levels: a superior sits one level above its subordinate; an agent outside any hierarchy sits
  // on its peer's level. The relaxation stops after as many passes as there are agents, so a cycle
  // of superiors cannot loop.
  function levels(topology) {
    const level = new Map(topology.agents.map((a) => [a.id, 0]));
    const rules = [];
    const ranked = new Set();
    for (const l of topology.links) {
      if (l.relationship === "superior") rules.push([l.from, l.to, 1]);
      else if (l.relationship === "subordinate") rules.push([l.to, l.from, 1]);
      else continue;
      ranked.add(l.from);
      ranked.add(l.to);
    }
    for (let pass = 0; pass < topology.agents.length; pass++) {
      let changed = false;
      for (const [up, down, step] of rules) {
        const want = (level.get(up) || 0) + step;
        if ((level.get(down) || 0) < want) { level.set(down, want); changed = true; }
      }
      for (const l of topology.links) {
        if (l.relationship !== "peer") continue;
        const top = Math.max(level.get(l.from) || 0, level.get(l.to) || 0);
        for (const a of [l.from, l.to]) if (!ranked.has(a) && (level.get(a) || 0) < top) { level.set(a, top); changed = true; }
      }
      if (!changed) break;
    }
    return level;
  }

  function positions(topology) {
    const level = levels(topology);
    const rows = new Map();
    for (const a of topology.agents) {
      const l = level.get(a.id) || 0;
      if (!rows.has(l)) rows.set(l, []);
      rows.get(l).push(a.id);
    }
    const at = {};
    for (const [l, ids] of rows) ids.forEach((id, i) => { at[id] = { x: (i - (ids.length - 1) / 2) * 220, y: l * 140 }; });
    return at;
  }

  function edgeLabel(l) { return l.relationship + (l.direction === "one_way" ? " · one-way" : "") + (l.enabled ? "" : " · disabled"); }

  function graphStyle() {
    const coloured = (name, colour) => ({ selector: "edge." + name, style: { "line-color": colour, "target-arrow-color": colour, "source-arrow-color": colour } });
    return [
      { selector: "node", style: { label: "data(label)", "text-valign": "center", "text-halign": "center",
        shape: "round-rectangle", width: "label", height: 34, padding: "12px", "background-color": "#fff",
        "border-width": 2, "border-color": "#47506a", color: "#1d2330", "font-size": 13, "min-zoomed-font-size": 0 } },
      { selector: "node.idle", style: { "border-color": "#1f9d6b" } },
      { selector: "node.running", style: { "border-color": "#f08c00", "border-width": 3 } },
      { selector: "node.stopped", style: { "border-color": "#b4b9c4", color: "#8a90a0" } },
      { selector: "node.busy", style: { "background-color": "#fff3e0" } },
      { selector: "node.remote", style: { "border-style": "dashed", "background-color": "#f4f1ff" } },
      { selector: "node.drop", style: { "border-color": "#2f6fdb", "border-width": 4 } },
      { selector: "node.ghost", style: { width: 1, height: 1, padding: 0, opacity: 0, label: "" } },
      { selector: "edge", style: { width: 2.5, "curve-style": "bezier", label: "data(label)", "font-size": 11,
        "text-background-color": "#fff", "text-background-opacity": 0.95, "text-background-padding": 2,
        "text-wrap": "none", "text-rotation": "none", "min-zoomed-font-size": 0,
        "target-arrow-shape": "triangle", "arrow-scale": 1.3, "source-arrow-shape": "none" } },
      { selector: "edge.two_way", style: { "source-arrow-shape": "triangle" } },
      coloured("superior", COLOURS.superior), coloured("subordinate", COLOURS.subordinate), coloured("peer", COLOURS.peer),
      { selector: "edge.disabled", style: { "line-style": "dashed", "line-color": COLOURS.disabled,
        "target-arrow-color": COLOURS.disabled, "source-arrow-color": COLOURS.disabled, color: "#6b7385" } },
      { selector: "edge.hot", style: { width: 6, "line-color": COLOURS.hot, "target-arrow-color": COLOURS.hot, "source-arrow-color": COLOURS.hot } },
      { selector: "edge.ghost", style: { "line-style": "dotted", "line-color": "#2f6fdb", "target-arrow-color": "#2f6fdb", label: "" } },
      { selector: "edge:selected", style: { width: 5, "overlay-color": "#2f6fdb", "overlay-opacity": 0.15 } },
    ];
  }

  function renderLegend() {
    for (const sw of document.querySelectorAll(".legend .sw[data-kind]")) {
      const colour = COLOURS[sw.dataset.kind];
      if (sw.dataset.kind === "disabled") sw.style.borderTopColor = colour;
      else sw.style.backgroundColor = colour;
    }
  }

  function renderGraph(topology) {
    const at = positions(topology);
    const elements = [];
    for (const a of topology.agents) {
      const view = state.agents.find((x) => x.id === a.id) || {};
      const status = view.status || "stopped";
      // A remote A2A agent: a dashed node, "A2A" after its name.
      const label = view.remote ? a.name + " · A2A" : a.name;
      elements.push({ group: "nodes", data: { id: "agent:" + a.id, agent: a.id, label, remote: view.remote || "" },
        classes: status + (view.remote ? " remote" : "") });
    }
    for (const l of topology.links) {
      elements.push({
        group: "edges",
        data: { id: "link:" + l.id, link: l.id, source: "agent:" + l.from, target: "agent:" + l.to, label: edgeLabel(l) },
        classes: edgeClasses(l),
      });
    }
    const layout = { name: "preset", positions: (node) => at[node.data("agent")] || { x: 0, y: 0 }, fit: true, padding: 40 };
    if (!state.cy) {
      state.cy = cytoscape({
        container: $("#graph"), elements, style: graphStyle(), layout,
        wheelSensitivity: 0.3, autoungrabify: true, boxSelectionEnabled: false, minZoom: 0.4, maxZoom: 1.6,
      });
      wireEditor(state.cy);
      let width = $("#graph").clientWidth;
      new ResizeObserver(() => {
        if ($("#graph").clientWidth === width) return;
        width = $("#graph").clientWidth;
        state.cy.resize();
        state.cy.fit(undefined, 40);
      }).observe($("#graph"));
    } else {
      state.cy.json({ elements });
      state.cy.layout(layout).run();
    }
    if (state.editing && !topology.links.some((l) => l.id === state.editing)) closeEditor();
  }

  // Drag from one agent to another: a dotted line follows the pointer; letting go over another
  // agent creates the link (two-way, peer) and opens it in the editor.
  function wireEditor(cy) {
    let drag = null;
    const nodeAt = (pos) => cy.nodes(":not(.ghost)").filter((n) => {
      const b = n.boundingBox();
      return pos.x >= b.x1 && pos.x <= b.x2 && pos.y >= b.y1 && pos.y <= b.y2;
    })[0];
    cy.on("tapstart", "node", (e) => {
      if (e.target.hasClass("ghost")) return;
      drag = { from: e.target, moved: false };
      cy.userPanningEnabled(false);
    });
    cy.on("tapdrag", (e) => {
      if (!drag) return;
      if (!drag.moved) {
        drag.moved = true;
        cy.add([{ group: "nodes", data: { id: "ghost" }, classes: "ghost", position: { ...e.position } },
          { group: "edges", data: { id: "ghost-edge", source: drag.from.id(), target: "ghost" }, classes: "ghost" }]);
      }
      cy.getElementById("ghost").position({ ...e.position });
      const over = nodeAt(e.position);
      cy.nodes().removeClass("drop");
      if (over && over !== drag.from) over.addClass("drop");
    });
    cy.on("tapend", async (e) => {
      if (!drag) return;
      const { from, moved } = drag;
      drag = null;
      cy.userPanningEnabled(true);
      cy.remove("#ghost, #ghost-edge");
      cy.nodes().removeClass("drop");
      const to = moved ? nodeAt(e.position) : null;
      if (!to || to === from) return;
      try {
        const link = await api("POST", "/api/links", { from: from.data("agent"), to: to.data("agent") });
        await refreshTopology();
        openEditor(link.id);
      } catch (err) { showError(err.message); }
    });
    cy.on("tap", "node", (e) => { if (!e.target.hasClass("ghost")) selectBoard(e.target.data("agent")); });
    cy.on("tap", "edge", (e) => { if (!e.target.hasClass("ghost")) { openEditor(e.target.data("link")); selectTimeline(e.target.data("link")); } });
  }

  function openEditor(linkId) {
    const link = state.links.find((l) => l.id === linkId);
    if (!link) return;
    state.editing = linkId;
    const form = $("#edge-editor");
    form.hidden = false;
    form.dataset.link = linkId;
    $("#edge-title").textContent = link.from + " → " + link.to;
    $("#edge-direction").value = link.direction;
    $("#edge-relationship").value = link.relationship;
    $("#edge-enabled").checked = link.enabled;
    if (state.cy) { state.cy.edges().unselect(); state.cy.getElementById("link:" + linkId).select(); }
  }

  function closeEditor() {
    state.editing = null;
    $("#edge-editor").hidden = true;
    if (state.cy) state.cy.edges().unselect();
  }

  async function applyEdge(event) {
    event.preventDefault();
    const id = state.editing;
    if (!id) return;
    try {
      await api("PATCH", "/api/links/" + encodeURIComponent(id), {
        direction: $("#edge-direction").value, relationship: $("#edge-relationship").value, enabled: $("#edge-enabled").checked });
      await refreshTopology();
      openEditor(id);
      $("#edge-saved").textContent = "saved · applies at once";
    } catch (e) { showError(e.message); }
  }

  async function deleteEdge() {
    const id = state.editing;
    if (!id) return;
    try { await api("DELETE", "/api/links/" + encodeURIComponent(id)); closeEditor(); await refreshTopology(); }
    catch (e) { showError(e.message); }
  }

  function flashEdge(a, b) {
    if (!state.cy || !a || !b) return;
    const link = state.links.find((l) => (l.from === a && l.to === b) || (l.from === b && l.to === a));
    if (!link) return;
    const edge = state.cy.getElementById("link:" + link.id);
    edge.addClass("hot");
    setTimeout(() => edge.removeClass("hot"), 1500);
  }

  function renderLinks() {
    const body = $("#links tbody");
    body.replaceChildren(...state.links.map((l) => {
      const tr = el("tr", l.enabled ? "" : "disabled");
      tr.dataset.link = l.id;
      for (const v of [l.from, l.to, l.direction, l.relationship]) tr.append(el("td", "", v));
      const td = el("td");
      const box = el("input");
      box.type = "checkbox";
      box.checked = l.enabled;
      box.title = "enable or disable the link";
      box.addEventListener("change", async () => {
        try { await api("PATCH", "/api/links/" + encodeURIComponent(l.id), { enabled: box.checked }); await refreshTopology(); }
        catch (e) { showError(e.message); box.checked = !box.checked; }
      });
      td.append(box);
      tr.append(td);
      tr.addEventListener("click", (e) => { if (e.target !== box) openEditor(l.id); });
      return tr;
    }));
    fillSelect($("#timeline-link"), state.links.map((l) => [l.id, l.from + " → " + l.to]), true);
  }

  async function refreshTopology() {
    const [agents, topology, links] = await Promise.all([api("GET", "/api/agents"), api("GET", "/api/topology"), api("GET", "/api/links")]);
    state.agents = agents;
    state.links = links;
    renderGraph(topology);
    renderLinks();
    const agentOptions = agents.map((a) => [a.id, a.name]);
    fillSelect($("#chat-agent"), agentOptions, true);
    fillSelect($("#board-agent"), agentOptions, true);
  }

  // ---- task board ----
  const COLUMNS = [["waiting for approval", ["pending_approval", "backlog"]], ["active", ["ready", "in_progress", "waiting"]], ["ended", ["done", "failed", "cancelled"]]];

  async function refreshTasks() {
    const agent = $("#board-agent").value;
    if (!agent) return;
    const tasks = await api("GET", "/api/agents/" + encodeURIComponent(agent) + "/tasks");
    if ($("#board-agent").value !== agent) return;
    $("#tasks").replaceChildren(...COLUMNS.map(([title, statuses]) => {
      const col = el("div", "col");
      col.append(el("h3", "", title));
      for (const t of tasks.filter((t) => statuses.includes(t.status))) {
        const card = el("div", "task " + t.status);
        card.dataset.task = t.reference;
        card.dataset.status = t.status;
        card.append(el("span", "ref", t.reference + " "), el("span", "", t.title));
        card.append(el("span", "meta", " " + t.status + (t.delegated_by ? " · from " + t.delegated_by : "")));
        // Spend: the tokens the task's own workers used.
        card.append(el("span", "spend", t.usage ? " · " + t.usage.total_tokens + " tokens" : " · 0 tokens"));
        if (t.trace_id) {
          // The request's OpenTelemetry trace: a link when the server has a trace URL template.
          const linked = t.trace_url && /^https?:\/\//.test(t.trace_url);
          const trace = el(linked ? "a" : "span", "trace", "trace " + t.trace_id.slice(0, 8));
          trace.title = "trace " + t.trace_id;
          trace.dataset.traceId = t.trace_id;
          if (linked) { trace.href = t.trace_url; trace.target = "_blank"; trace.rel = "noopener"; }
          card.append(el("br"), trace);
        }
        const actions = [];
        if (t.status === "pending_approval") actions.push(["approve", null], ["reject", { reason: "rejected from the dashboard" }]);
        if (!["done", "failed", "cancelled"].includes(t.status)) actions.push(["cancel", { reason: "cancelled from the dashboard" }]);
        for (const [action, body] of actions) {
          const b = el("button", "", action);
          b.addEventListener("click", async () => {
            try { await api("POST", "/api/agents/" + encodeURIComponent(agent) + "/tasks/" + t.number + "/" + action, body || undefined); await refreshTasks(); }
            catch (e) { showError(e.message); }
          });
          card.append(el("br"), b);
        }
        col.append(card);
      }
      if (col.children.length === 1) col.append(el("div", "empty", "none"));
      return col;
    }));
  }

  function selectBoard(agent) { $("#board-follow").checked = false; $("#board-agent").value = agent; refreshTasks().catch((e) => showError(e.message)); }

  // ---- link timeline ----
  async function refreshTimeline() {
    const link = $("#timeline-link").value;
    if (!link) { $("#timeline").replaceChildren(el("div", "empty", "no links")); return; }
    const timeline = await api("GET", "/api/links/" + encodeURIComponent(link) + "/timeline?limit=100");
    if ($("#timeline-link").value !== link) return;
    // A system record written to both sides of the link (an assignment, a completion) shows once.
    const seen = new Set();
    const unique = timeline.records.filter((r) => {
      if (r.kind !== "system") return true;
      const key = [r.at, r.author, r.content].join("\u0000");
      if (seen.has(key)) return false;
      seen.add(key);
      return true;
    });
    const records = unique.map((r) => {
      const row = el("div", "record " + r.kind);
      row.append(el("span", "meta", new Date(r.at).toLocaleTimeString() + " · " + r.channel + " · " + r.kind + " · " + r.author));
      row.append(document.createTextNode(r.content));
      return row;
    });
    $("#timeline").replaceChildren(...(records.length ? records : [el("div", "empty", "nothing yet")]));
    $("#timeline").scrollTop = $("#timeline").scrollHeight;
  }

  function selectTimeline(link) { $("#timeline-follow").checked = false; $("#timeline-link").value = link; refreshTimeline().catch((e) => showError(e.message)); }

  // ---- shared notes ----
  // Note texts are written by models: every piece of a note reaches the page through textContent
  // (el, createTextNode), never as markup.
  const ACCESS_CHOICES = [["", "none"], ["read", "read"], ["read_write", "read / write"]];
  const notePath = (name) => "/api/notes/" + encodeURIComponent(name);
  const when = (ms) => (ms ? new Date(ms).toLocaleString() : "—");

  async function refreshMcp() {
    if (state.health && !state.health.mcp_tools) {
      // Served without MCP tools: nothing is wrong, there is just nothing to show.
      $("#mcp-status").textContent = "MCP tools are not served by this API.";
      $("#mcp-status").hidden = false;
      return;
    }
    let view, calls;
    try { [view, calls] = await Promise.all([api("GET", "/api/mcp/servers"), api("GET", "/api/mcp/calls")]); }
    catch (e) {
      if (e.status !== 404) throw e;
      // Served without MCP tools: nothing is wrong, there is just nothing to show.
      $("#mcp-status").textContent = "MCP tools are not served by this API.";
      $("#mcp-status").hidden = false;
      return;
    }
    $("#mcp-status").textContent = view.servers.length ? "" : "No MCP servers configured.";
    $("#mcp-status").hidden = view.servers.length > 0;
    $("#mcp-servers tbody").replaceChildren(...view.servers.map((sv) => {
      const tr = el("tr", "mcp-" + sv.state);
      tr.dataset.server = sv.id;
      tr.append(el("td", "name", sv.id), el("td", "state", sv.detail), el("td", "starts", String(sv.starts)),
        el("td", "tools", sv.tools.join(", ") || "—"));
      return tr;
    }));
    $("#mcp-grants tbody").replaceChildren(...view.grants.map((g) => {
      const tr = el("tr");
      tr.append(el("td", "name", g.agent), el("td", "grants", g.grants.join(", ")), el("td", "approval", g.approval.join(", ") || "—"));
      return tr;
    }));
    const pending = calls.filter((c) => c.status === "pending");
    $("#mcp-calls tbody").replaceChildren(...pending.map((c) => {
      const tr = el("tr");
      const actions = el("td", "actions");
      for (const action of ["approve", "reject"]) {
        const button = el("button", "", action);
        button.addEventListener("click", async () => {
          try { await api("POST", "/api/mcp/calls/" + encodeURIComponent(c.id) + "/" + action); await refreshMcp(); }
          catch (e) { showError(e.message); }
        });
        actions.append(button);
      }
      tr.append(el("td", "name", c.agent), el("td", "tool", c.server + ":" + c.tool), el("td", "arguments", JSON.stringify(c.arguments)), actions);
      return tr;
    }));
  }

  function agentsWith(access, kind) {
    return Object.keys(access || {}).filter((a) => access[a] === kind).sort().join(", ") || "—";
  }

  function notesStatus(text) {
    $("#notes-status").textContent = text || "";
    $("#notes-status").hidden = !text;
    $("#notes").hidden = !!text;
    if (text) $("#note-view").hidden = true;
  }

  async function refreshNotes() {
    const seq = ++state.notesSeq;
    let notes;
    if (state.health && !state.health.notes) {
      if (seq === state.notesSeq) { state.notes = []; state.note = null; notesStatus("Shared notes are not enabled in this organization."); }
      return;
    }
    try { notes = await api("GET", "/api/notes"); }
    catch (e) {
      if (e.status !== 404) throw e;
      // Served without shared notes: nothing is wrong, there is just nothing to show.
      if (seq === state.notesSeq) { state.notes = []; state.note = null; notesStatus("Shared notes are not enabled in this organization."); }
      return;
    }
    if (seq !== state.notesSeq) return;
    state.notes = notes;
    if (!notes.some((n) => n.name === state.note)) { state.note = notes.length ? notes[0].name : null; state.noteVersion = null; }
    notesStatus(notes.length ? "" : "No shared notes yet.");
    $("#notes tbody").replaceChildren(...notes.map((n) => {
      const tr = el("tr", n.name === state.note ? "selected" : "");
      tr.dataset.note = n.name;
      tr.dataset.version = String(n.version);
      if (n.description) tr.title = n.description;
      tr.append(el("td", "name", n.name), el("td", "version", n.version ? String(n.version) : "0 (never written)"),
        el("td", "author", n.author || "—"), el("td", "updated", when(n.written_at)),
        el("td", "readers", agentsWith(n.access, "read")), el("td", "writers", agentsWith(n.access, "read_write")));
      tr.addEventListener("click", () => selectNote(n.name));
      return tr;
    }));
    await refreshNote(seq);
  }

  async function refreshNote(seq) {
    const note = state.notes.find((n) => n.name === state.note);
    if (!note) { $("#note-view").hidden = true; return; }
    let history = [];
    if (note.version) {
      try { history = await api("GET", notePath(note.name) + "/history"); }
      catch (e) { if (e.status !== 404) throw e; }
    }
    if (seq !== state.notesSeq || state.note !== note.name) return;
    state.noteHistory = history;
    renderNote();
  }

  function renderNote() {
    const note = state.notes.find((n) => n.name === state.note);
    if (!note) { $("#note-view").hidden = true; return; }
    for (const tr of $("#notes tbody").children) tr.classList.toggle("selected", tr.dataset.note === note.name);
    // An older version chosen in the history stays shown until another is chosen; otherwise the latest.
    const older = state.noteVersion !== null ? state.noteHistory.find((v) => v.version === state.noteVersion) : null;
    const shown = older || (note.version ? { version: note.version, text: note.text, author: note.author, written_at: note.written_at } : null);
    $("#note-view").hidden = false;
    $("#note-view").dataset.note = note.name;
    $("#note-title").textContent = note.name;
    $("#note-description").textContent = note.description;
    const text = $("#note-text");
    text.dataset.version = shown ? String(shown.version) : "0";
    text.textContent = shown ? shown.text : "";
    text.classList.toggle("old", !!older);
    $("#note-meta").textContent = shown
      ? "version " + shown.version + (older ? " (latest: " + note.version + ")" : " (latest)") + " · by " + shown.author + " · " + when(shown.written_at)
      : "never written";
    $("#note-history").replaceChildren(...state.noteHistory.slice().reverse().map((v) => {
      const li = el("li", shown && v.version === shown.version ? "current" : "");
      li.dataset.version = String(v.version);
      const b = el("button", "", "version " + v.version);
      b.type = "button";
      b.addEventListener("click", () => { state.noteVersion = v.version === note.version ? null : v.version; renderNote(); });
      li.append(b, el("span", "meta", " " + v.author + " · " + when(v.written_at)));
      return li;
    }));
    if (!state.noteHistory.length) $("#note-history").replaceChildren(el("li", "empty", "nothing written yet"));
    renderNoteAccess(note);
  }

  function renderNoteAccess(note) {
    const agents = state.agents.map((a) => [a.id, a.name]);
    for (const id of Object.keys(note.access || {})) if (!agents.some(([a]) => a === id)) agents.push([id, id]);
    $("#note-access tbody").replaceChildren(...agents.map(([id, name]) => {
      const tr = el("tr");
      tr.dataset.agent = id;
      tr.append(el("td", "", name === id ? id : name + " (" + id + ")"));
      const select = el("select");
      select.title = "what " + id + " may do with " + note.name;
      fillSelect(select, ACCESS_CHOICES, false);
      const current = (note.access || {})[id] || "";
      select.value = current;
      select.addEventListener("change", async () => {
        const path = notePath(note.name) + "/access/" + encodeURIComponent(id);
        try {
          if (select.value) await api("PUT", path, { access: select.value });
          else await api("DELETE", path);
          await refreshNotes();
        } catch (e) { showError(e.message); select.value = current; }
      });
      const td = el("td");
      td.append(select);
      tr.append(td);
      return tr;
    }));
  }

  function selectNote(name) {
    state.note = name;
    state.noteVersion = null;
    state.noteHistory = [];
    refreshNote(state.notesSeq).catch((e) => showError(e.message));
  }

  let notesTimer = null;
  function scheduleNotesRefresh() {
    if (notesTimer) return;
    notesTimer = setTimeout(() => {
      notesTimer = null;
      refreshNotes().catch((e) => showError(e.message));
    }, 100);
  }

  // ---- chat ----
  // The chat id is kept in this browser, so a reload finds the conversation again in the agent's
  // channel web:{chat id}.
  const chatId = (() => {
    let id = null;
    try { id = localStorage.getItem("spacebot-chat-id"); } catch (e) { id = null; }
    if (!id) {
      id = "dashboard-" + Math.random().toString(36).slice(2, 10);
      try { localStorage.setItem("spacebot-chat-id", id); } catch (e) { /* private mode: this tab only */ }
    }
    return id;
  })();
  const chatChannel = "web:" + chatId;

  function chatLine(kind, who, text) {
    const line = el("div", "msg " + kind);
    line.append(el("span", "who", who), document.createTextNode(text));
    $("#chat-log").append(line);
    $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
    return line;
  }

  async function loadChatHistory() {
    const agent = $("#chat-agent").value;
    if (!agent) return;
    let records = [];
    try { records = await api("GET", "/api/agents/" + encodeURIComponent(agent) + "/channels/" + encodeURIComponent(chatChannel) + "?limit=100"); }
    catch (e) { if (e.status !== 404) throw e; }
    if ($("#chat-agent").value !== agent) return;
    $("#chat-log").replaceChildren();
    for (const r of records) {
      if (r.kind === "user") chatLine("user history", "you → " + agent, r.content);
      else if (r.kind === "assistant") chatLine("agent history", r.author, r.content);
      else if (r.kind === "system" && /^turn failed|could not answer/.test(r.content)) chatLine("failure history", r.author + " (failed)", r.content);
    }
    if (!records.length) $("#chat-log").append(el("div", "empty", "No messages yet in this chat."));
    for (const [, work] of state.working) if (work.agent === agent) $("#chat-log").append(work.node);
  }

  function setWorking() {
    const n = state.working.size;
    $("#chat-status").textContent = n ? "working…" : "";
    $("#chat-status").className = n ? "working" : "";
  }

  // Steps are kept per request (the last 50 requests) as they come: a fast request may be done
  // before the page learns its id from the POST's answer.
  function step(request, text) {
    if (!state.steps.has(request)) {
      state.steps.set(request, []);
      if (state.steps.size > 50) state.steps.delete(state.steps.keys().next().value);
    }
    state.steps.get(request).push(text);
    const work = state.working.get(request);
    if (!work) return;
    work.steps.append(el("li", "", text));
    $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  }

  function finishWork(id) {
    const work = state.working.get(id);
    if (!work) return;
    state.working.delete(id);
    work.node.classList.remove("working");
    work.node.classList.add("done-steps");
    work.stream.remove();
    work.node.querySelector(".who").textContent = "steps";
    setWorking();
  }

  async function sendChat(event) {
    event.preventDefault();
    const input = $("#chat-input");
    const content = input.value.trim();
    const agent = $("#chat-agent").value;
    if (!content || !agent) return;
    input.value = "";
    const empty = $("#chat-log .empty");
    if (empty) empty.remove();
    chatLine("user", "you → " + agent, content);
    try {
      const accepted = await api("POST", "/api/agents/" + encodeURIComponent(agent) + "/messages", { content, chat_id: chatId });
      const node = el("div", "msg working");
      node.dataset.request = accepted.envelope_id;
      node.append(el("span", "who", agent + " is working…"));
      const steps = el("ol", "steps");
      const stream = el("div", "streaming");
      node.append(steps, stream);
      for (const text of state.steps.get(accepted.envelope_id) || []) steps.append(el("li", "", text));
      $("#chat-log").append(node);
      state.working.set(accepted.envelope_id, { agent, node, steps, stream });
      setWorking();
      if (state.answered.has(accepted.envelope_id)) finishWork(accepted.envelope_id);
      state.followRequest = accepted.envelope_id;
      scheduleRequests();
    } catch (e) { showError(e.message); }
  }

  function onDelta(d) {
    if (d.channel !== chatChannel) return;
    const work = [...state.working.values()].find((w) => w.agent === d.agent) || null;
    if (!work) return;
    if (d.discard) { work.stream.textContent = ""; return; }
    work.stream.textContent += d.text;
    work.node.classList.add("has-stream");
    $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  }

  // ---- requests ----
  const STEP_KINDS = new Set(["turn_started", "model_called", "tool_called", "task_created", "task_claimed", "task_completed",
    "task_failed", "steered", "refused", "limit_wait", "limit_reached", "round_limit_reached"]);

  function stepText(e) {
    const k = e.kind;
    switch (k.type) {
      case "turn_started": return e.agent + ": turn" + (e.task ? " on " + e.task.agent + "#" + e.task.number : "");
      case "model_called": return e.agent + ": model call" + (k.tool_calls ? " → tools" : "") + (e.usage ? " · " + e.usage.total_tokens + " tokens" : "");
      case "tool_called": return e.agent + ": " + k.tool + (k.ok ? "" : " (failed)");
      case "refused": return e.agent + ": refused " + k.action + " → " + k.target + ": " + k.reason;
      case "limit_wait": return e.agent + ": waits for budget (" + k.over.limit + " " + k.over.value + " of " + k.over.max + " with the open calls)";
      default: return describe(e);
    }
  }

  let requestsTimer = null;
  function scheduleRequests() {
    if (requestsTimer) return;
    requestsTimer = setTimeout(() => { requestsTimer = null; refreshRequests().catch((e) => showError(e.message)); }, 120);
  }

  async function refreshRequests() {
    const list = await api("GET", "/api/requests?limit=30");
    const select = $("#request-select");
    fillSelect(select, list.map((r) => [r.request, when(r.started_at).split(", ").pop() + " · " + r.agent + " · " + r.status]), true);
    if ($("#request-follow").checked && list.length) {
      const want = state.followRequest && list.some((r) => r.request === state.followRequest) ? state.followRequest : list[0].request;
      select.value = want;
    }
    // A request that ended before the page knew its id (its reply came first) stops working.
    for (const r of list) if (r.status !== "running") { state.answered.add(r.request); finishWork(r.request); }
    if (!list.length) { $("#request-tree").replaceChildren(el("li", "empty", "No requests yet: send a message.")); return; }
    await refreshTree();
  }

  function duration(n) {
    if (n.ended_at === undefined || n.ended_at === null) return "";
    const ms = n.ended_at - n.started_at;
    return ms >= 1000 ? (ms / 1000).toFixed(1) + " s" : ms + " ms";
  }

  async function refreshTree() {
    const request = $("#request-select").value;
    if (!request) return;
    const tree = await api("GET", "/api/requests/" + encodeURIComponent(request) + "/tree");
    if ($("#request-select").value !== request) return;
    const root = $("#request-tree");
    root.dataset.request = request;
    root.dataset.status = tree.status;
    const items = new Map();
    const top = [];
    for (const n of tree.nodes) {
      const li = el("li", "node " + n.kind + " " + n.status);
      li.dataset.kind = n.kind;
      li.dataset.agent = n.agent;
      li.dataset.status = n.status;
      if (n.task) li.dataset.task = n.task;
      const line = el("div", "line");
      line.append(el("span", "badge", n.kind.replace("_", " ")), el("span", "agent", n.agent), el("span", "label", n.label),
        el("span", "status", n.status));
      const facts = [duration(n), n.usage ? n.usage.total_tokens + " tokens" : ""].filter(Boolean).join(" · ");
      if (facts) line.append(el("span", "meta", facts));
      li.append(line);
      items.set(n.id, li);
      const parent = n.parent === null || n.parent === undefined ? null : items.get(n.parent);
      if (parent) {
        let ul = parent.querySelector(":scope > ul");
        if (!ul) { ul = el("ul"); parent.append(ul); }
        ul.append(li);
      } else top.push(li);
    }
    root.replaceChildren(...top);
    const spend = tree.spend ? " · spent " + tree.spend.spent.total_tokens + " tokens, " + tree.spend.spent.model_calls + " model calls" +
      (tree.spend.spent.cost ? ", cost " + tree.spend.spent.cost.toFixed(4) : "") + (tree.spend.reached ? " · limit reached: " + tree.spend.reached.message : "") : "";
    $("#request-summary").textContent = tree.status + " · " + tree.agents.join(", ") + " · " + tree.usage.total_tokens + " tokens" + spend;
  }

  // ---- approvals ----
  async function refreshApprovals() {
    const view = await api("GET", "/api/approvals");
    const rows = [];
    for (const t of view.tasks) {
      const row = el("div", "approval task-approval");
      row.dataset.task = t.reference;
      row.append(el("span", "ref", t.reference + " "), el("span", "", t.title), el("span", "meta", " from " + (t.delegated_by || t.created_by)));
      for (const [action, body] of [["approve", undefined], ["reject", { reason: "rejected from the console" }]]) {
        const b = el("button", action, action);
        b.addEventListener("click", async () => {
          try { await api("POST", "/api/agents/" + encodeURIComponent(t.agent) + "/tasks/" + t.number + "/" + action, body); await refreshApprovals(); scheduleRefresh(); }
          catch (e) { showError(e.message); }
        });
        row.append(b);
      }
      rows.push(row);
    }
    for (const c of view.mcp_calls) {
      const row = el("div", "approval call-approval");
      row.dataset.call = c.id;
      row.append(el("span", "ref", c.agent + " "), el("span", "", c.server + ":" + c.tool + " "), el("code", "", JSON.stringify(c.arguments)));
      for (const action of ["approve", "reject"]) {
        const b = el("button", action, action);
        b.addEventListener("click", async () => {
          try { await api("POST", "/api/mcp/calls/" + encodeURIComponent(c.id) + "/" + action); await refreshApprovals(); refreshMcp().catch(() => {}); }
          catch (e) { showError(e.message); }
        });
        row.append(b);
      }
      rows.push(row);
    }
    $("#approvals").replaceChildren(...(rows.length ? rows : [el("div", "empty", "Nothing waits for approval.")]));
    $("#approvals-count").textContent = rows.length ? String(rows.length) : "";
  }

  // ---- live events ----
  let refreshTimer = null;
  function scheduleRefresh() {
    if (refreshTimer) return;
    refreshTimer = setTimeout(async () => {
      refreshTimer = null;
      try { await Promise.all([refreshTasks(), refreshTimeline(), refreshAgents(), refreshApprovals()]); } catch (e) { showError(e.message); }
    }, 150);
  }

  async function refreshAgents() {
    state.agents = await api("GET", "/api/agents");
    if (!state.cy) return;
    for (const a of state.agents) {
      const node = state.cy.getElementById("agent:" + a.id);
      node.removeClass("idle running stopped").addClass(a.status);
    }
  }

  function describe(e) {
    const k = e.kind || {};
    const parts = [e.agent, k.type === "behaviour" ? k.behaviour + ":" : k.type];
    if (k.to) parts.push("→ " + k.to);
    if (k.from) parts.push("← " + k.from);
    if (k.target) parts.push("→ " + k.target);
    if (e.task) parts.push(e.task.agent + "#" + e.task.number);
    if (k.error) parts.push(k.error);
    if (k.reason) parts.push(k.reason);
    if (k.type === "behaviour") parts.push(k.name + (k.detail && k.detail.name ? " " + k.detail.name : ""));
    return parts.join(" ");
  }

  function activity(text) {
    const list = $("#activity");
    list.prepend(el("li", "", new Date().toLocaleTimeString() + " " + text));
    while (list.children.length > 200) list.lastChild.remove();
  }

  // The board and the timeline follow the activity (unless their "follow" box is unticked).
  function follow(e) {
    const k = e.kind || {};
    if ($("#board-follow").checked && e.task && k.type && k.type.startsWith("task_") && $("#board-agent").value !== e.task.agent) {
      $("#board-agent").value = e.task.agent;
    }
    if ($("#timeline-follow").checked && e.link && state.links.some((l) => l.id === e.link) && $("#timeline-link").value !== e.link) {
      $("#timeline-link").value = e.link;
    }
  }

  function onOrgEvent(e) {
    const k = e.kind || {};
    if (k.type !== "model_called") activity(describe(e));
    follow(e);
    if (k.type === "message_sent") flashEdge(e.agent, k.to);
    if (k.type === "message_received") flashEdge(k.from, e.agent);
    if (k.type && k.type.startsWith("task_") && e.task) {
      const delegator = (k.created_by || "").startsWith("agent:") ? k.created_by.slice(6) : null;
      flashEdge(delegator, e.task.agent);
    }
    if (k.type === "notice_delivered" && e.link) {
      const link = state.links.find((l) => l.id === e.link);
      if (link) flashEdge(link.from, link.to);
    }
    if (k.type === "turn_started" && state.cy) state.cy.getElementById("agent:" + e.agent).addClass("busy");
    if ((k.type === "turn_finished" || k.type === "agent_idle") && state.cy) state.cy.getElementById("agent:" + e.agent).removeClass("busy");
    if (k.type === "behaviour" && k.behaviour === "notes") scheduleNotesRefresh();
    if (e.request) {
      if (STEP_KINDS.has(k.type)) step(e.request, stepText(e));
      scheduleRequests();
    }
    scheduleRefresh();
  }

  function onReply(r) {
    const target = r.source && r.source.reply_target;
    activity(r.agent + (r.kind === "failure" ? " failed to answer" : " replied") + (target ? " to " + target : ""));
    scheduleRequests();
    if (target !== chatId) return;
    // A reply answers the message itself, or (after delegated work came back) the notice that
    // retriggered the agent: then it ends the agent's oldest work in this chat.
    let ids = (r.in_reply_to || []).filter((id) => state.working.has(id));
    if (!ids.length) {
      const oldest = [...state.working.entries()].find(([, w]) => w.agent === r.agent);
      if (oldest) ids = [oldest[0]];
    }
    for (const id of r.in_reply_to || []) state.answered.add(id);
    for (const id of ids) finishWork(id);
    setWorking();
    const failed = r.kind === "failure";
    chatLine(failed ? "failure" : "agent", r.agent + (failed ? " (failed)" : ""), r.content);
  }

  function connect() {
    if (state.source) state.source.close();
    const url = "/api/events" + (token() ? "?access_token=" + encodeURIComponent(token()) : "");
    const source = new EventSource(url);
    state.source = source;
    source.onopen = () => { $("#conn").textContent = "live"; $("#conn").className = "conn on"; };
    source.onerror = () => { $("#conn").textContent = "reconnecting…"; $("#conn").className = "conn off"; };
    source.addEventListener("org", (m) => onOrgEvent(JSON.parse(m.data)));
    source.addEventListener("reply", (m) => onReply(JSON.parse(m.data)));
    source.addEventListener("delta", (m) => onDelta(JSON.parse(m.data)));
    source.addEventListener("missed", (m) => {
      activity("missed " + JSON.parse(m.data).missed + " events; reloading");
      refreshTopology().then(() => { scheduleRefresh(); scheduleNotesRefresh(); scheduleRequests(); }).catch((e) => showError(e.message));
    });
  }

  async function start() {
    showError("");
    renderLegend();
    try {
      state.health = await api("GET", "/api/health");
      await refreshTopology();
      $("#token-form").hidden = true;
      connect();
      await Promise.all([refreshTasks(), refreshTimeline(), refreshNotes(), refreshMcp(), loadChatHistory(), refreshRequests(), refreshApprovals()]);
      // Servers restart and calls wait for approval without an event of their own: look again.
      setInterval(() => { refreshMcp().catch((e) => showError(e.message)); refreshApprovals().catch((e) => showError(e.message)); }, 3000);
    } catch (e) { showError(e.message); }
  }

  // Errors of the page itself are shown, never only logged.
  window.addEventListener("error", (e) => showError("page error: " + e.message));
  window.addEventListener("unhandledrejection", (e) => showError("page error: " + (e.reason && e.reason.message ? e.reason.message : e.reason)));

  $("#token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("spacebot-token", $("#token-input").value.trim());
    start();
  });
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-agent").addEventListener("change", () => loadChatHistory().catch((e) => showError(e.message)));
  $("#board-agent").addEventListener("change", () => { $("#board-follow").checked = false; refreshTasks().catch((e) => showError(e.message)); });
  $("#timeline-link").addEventListener("change", () => { $("#timeline-follow").checked = false; refreshTimeline().catch((e) => showError(e.message)); });
  $("#request-select").addEventListener("change", () => { $("#request-follow").checked = false; refreshTree().catch((e) => showError(e.message)); });
  $("#edge-editor").addEventListener("submit", applyEdge);
  $("#edge-delete").addEventListener("click", deleteEdge);
  $("#edge-close").addEventListener("click", closeEditor);
  // For tests and the browser console.
  window.spacebotDashboard = {
    // The line style of a link's edge.
    edgeStyle: (link) => (state.cy ? state.cy.getElementById("link:" + link).style("line-style") : null),
    // Where an agent's node or a link's edge is on the page (CSS pixels from the viewport's corner).
    nodePoint: (agent) => point(state.cy && state.cy.getElementById("agent:" + agent).renderedPosition()),
    edgePoint: (link) => point(state.cy && state.cy.getElementById("link:" + link).renderedMidpoint()),
    // An edge's colour and its legend swatch's colour.
    edgeColour: (link) => (state.cy ? state.cy.getElementById("link:" + link).style("line-color") : null),
    nodeY: (agent) => (state.cy ? state.cy.getElementById("agent:" + agent).position("y") : null),
    chatId,
  };
  function point(p) {
    if (!p) return null;
    const box = $("#graph").getBoundingClientRect();
    return { x: box.left + p.x, y: box.top + p.y };
  }
  start();
})();
