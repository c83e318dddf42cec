// The spacebot dashboard: the organization's graph, live activity from the event stream, task
// boards, link timelines, shared notes and a chat box. Talks only to the public API of spacebot-http.
(function () {
  "use strict";

  const $ = (sel) => document.querySelector(sel);
  const chatId = "dashboard-" + Math.random().toString(36).slice(2, 10);
  const state = { agents: [], links: [], cy: null, source: null, pendingChat: new Set(),
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

  // ---- topology ----
  function edgeClasses(link) {
    return [link.relationship, link.direction, link.enabled ? "enabled" : "disabled"].join(" ");
  }

  function renderGraph(topology) {
    const elements = [];
    for (const a of topology.agents) {
      const status = (state.agents.find((x) => x.id === a.id) || {}).status || "stopped";
      elements.push({ data: { id: "agent:" + a.id, agent: a.id, label: a.name }, classes: status });
    }
    for (const l of topology.links) {
      elements.push({
        data: { id: "link:" + l.id, link: l.id, source: "agent:" + l.from, target: "agent:" + l.to,
          label: l.relationship + (l.enabled ? "" : " (disabled)") },
        classes: edgeClasses(l),
      });
    }
    if (!state.cy) {
      state.cy = cytoscape({
        container: $("#graph"),
        elements,
        wheelSensitivity: 0.3,
        style: [
          { selector: "node", style: { label: "data(label)", "text-valign": "center", "text-halign": "center",
            shape: "round-rectangle", width: "label", height: 34, padding: "12px", "background-color": "#fff",
            "border-width": 2, "border-color": "#47506a", color: "#1d2330", "font-size": 13 } },
          { selector: "node.idle", style: { "border-color": "#1f9d6b" } },
          { selector: "node.running", style: { "border-color": "#f08c00", "border-width": 3 } },
          { selector: "node.stopped", style: { "border-color": "#b4b9c4", color: "#8a90a0" } },
          { selector: "node.busy", style: { "background-color": "#fff3e0" } },
          { selector: "edge", style: { width: 2.5, "curve-style": "bezier", label: "data(label)", "font-size": 11,
            "text-background-color": "#fff", "text-background-opacity": 0.9, "text-background-padding": 2,
            "target-arrow-shape": "triangle", "arrow-scale": 1.2 } },
          { selector: "edge.two_way", style: { "source-arrow-shape": "triangle" } },
          { selector: "edge.superior", style: { "line-color": "#2f6fdb", "target-arrow-color": "#2f6fdb", "source-arrow-color": "#2f6fdb" } },
          { selector: "edge.subordinate", style: { "line-color": "#8a4fd3", "target-arrow-color": "#8a4fd3", "source-arrow-color": "#8a4fd3" } },
          { selector: "edge.peer", style: { "line-color": "#1f9d6b", "target-arrow-color": "#1f9d6b", "source-arrow-color": "#1f9d6b" } },
          { selector: "edge.disabled", style: { "line-style": "dashed", "line-color": "#b4b9c4",
            "target-arrow-color": "#b4b9c4", "source-arrow-color": "#b4b9c4", color: "#8a90a0" } },
          { selector: "edge.hot", style: { width: 6, "line-color": "#f08c00", "target-arrow-color": "#f08c00", "source-arrow-color": "#f08c00" } },
          { selector: ":selected", style: { "overlay-color": "#2f6fdb", "overlay-opacity": 0.15 } },
        ],
        layout: { name: "breadthfirst", directed: true, padding: 30, spacingFactor: 1.3 },
      });
      state.cy.on("tap", "node", (e) => { selectBoard(e.target.data("agent")); });
      state.cy.on("tap", "edge", (e) => { selectTimeline(e.target.data("link")); });
    } else {
      state.cy.json({ elements });
      state.cy.layout({ name: "breadthfirst", directed: true, padding: 30, spacingFactor: 1.3 }).run();
    }
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

  function selectBoard(agent) { $("#board-agent").value = agent; refreshTasks().catch((e) => showError(e.message)); }

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

  function selectTimeline(link) { $("#timeline-link").value = link; refreshTimeline().catch((e) => showError(e.message)); }

  // ---- shared notes ----
  // Note texts are written by models: every piece of a note reaches the page through textContent
  // (el, createTextNode), never as markup.
  const ACCESS_CHOICES = [["", "none"], ["read", "read"], ["read_write", "read / write"]];
  const notePath = (name) => "/api/notes/" + encodeURIComponent(name);
  const when = (ms) => (ms ? new Date(ms).toLocaleString() : "—");

  async function refreshMcp() {
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
  function chatLine(kind, who, text) {
    const line = el("div", "msg " + kind);
    line.append(el("span", "who", who), document.createTextNode(text));
    $("#chat-log").append(line);
    $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  }

  async function sendChat(event) {
    event.preventDefault();
    const input = $("#chat-input");
    const content = input.value.trim();
    const agent = $("#chat-agent").value;
    if (!content || !agent) return;
    input.value = "";
    chatLine("user", "you → " + agent, content);
    try {
      const accepted = await api("POST", "/api/agents/" + encodeURIComponent(agent) + "/messages", { content, chat_id: chatId });
      state.pendingChat.add(accepted.envelope_id);
    } catch (e) { showError(e.message); }
  }

  // ---- live events ----
  let refreshTimer = null;
  function scheduleRefresh() {
    if (refreshTimer) return;
    refreshTimer = setTimeout(async () => {
      refreshTimer = null;
      try { await Promise.all([refreshTasks(), refreshTimeline(), refreshAgents()]); } catch (e) { showError(e.message); }
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
    if (e.task) parts.push(e.task.agent + "#" + e.task.number);
    if (k.error) parts.push(k.error);
    if (k.type === "behaviour") parts.push(k.name + (k.detail && k.detail.name ? " " + k.detail.name : ""));
    return parts.join(" ");
  }

  function activity(text) {
    const list = $("#activity");
    list.prepend(el("li", "", new Date().toLocaleTimeString() + " " + text));
    while (list.children.length > 200) list.lastChild.remove();
  }

  function onOrgEvent(e) {
    const k = e.kind || {};
    activity(describe(e));
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
    scheduleRefresh();
  }

  function onReply(r) {
    const target = r.source && r.source.reply_target;
    activity(r.agent + " replied" + (target ? " to " + target : ""));
    if (target !== chatId) return;
    chatLine(r.kind === "failure" ? "failure" : "agent", r.agent, r.content);
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
    source.addEventListener("missed", (m) => {
      activity("missed " + JSON.parse(m.data).missed + " events; reloading");
      refreshTopology().then(() => { scheduleRefresh(); scheduleNotesRefresh(); }).catch((e) => showError(e.message));
    });
  }

  async function start() {
    showError("");
    try {
      await refreshTopology();
      $("#token-form").hidden = true;
      connect();
      await Promise.all([refreshTasks(), refreshTimeline(), refreshNotes(), refreshMcp()]);
      // Servers restart and calls wait for approval without an event of their own: look again.
      setInterval(() => refreshMcp().catch((e) => showError(e.message)), 3000);
    } catch (e) { showError(e.message); }
  }

  $("#token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("spacebot-token", $("#token-input").value.trim());
    start();
  });
  $("#chat-form").addEventListener("submit", sendChat);
  $("#board-agent").addEventListener("change", () => refreshTasks().catch((e) => showError(e.message)));
  $("#timeline-link").addEventListener("change", () => refreshTimeline().catch((e) => showError(e.message)));
  // For tests and the browser console: the line style of a link's edge.
  window.spacebotDashboard = {
    edgeStyle: (link) => (state.cy ? state.cy.getElementById("link:" + link).style("line-style") : null),
  };
  start();
})();
