// The "Plan your run" page: jaxdist_lessons.planning, the Python planner itself, run in Pyodide
// (CPython in WebAssembly), served with the book: no server, no network. The form's values
// become the command line's flags, planning.cli.page_json answers with the table and the rows (or the
// planner's one-line error), and this script draws them. Installed by _ext/planner.py.
"use strict";
(function () {
  const BASE = new URL(".", document.currentScript.src).href;
  const ZH = (document.documentElement.lang || "").toLowerCase().startsWith("zh");
  const TEXT = {
    ready: ["Ready: the planner runs in Python (Pyodide %s) in this page.",
            "就绪：规划器以 Python（Pyodide %s）在本页中运行。"],
    failed: ["The planner could not load: %s", "规划器未能加载：%s"],
    file: ["Opened as a file, the page cannot load the planner: serve the book (python -m http.server -d _build/html)",
           "作为文件打开时，本页无法加载规划器：请用网页服务器提供本书（python -m http.server -d _build/html）"],
    bug: ["The planner failed: %s", "规划器出错：%s"],
    usable: ["usable: %s GB", "可用：%s GB"],
    axis: ["GB per device (predicted)", "每个设备的 GB（预测）"],
    model: ["Model", "模型"], preset: ["preset", "预设"], custom: ["custom shape", "自定义形状"],
    machines: ["Devices and batch", "设备与批量"], plan: ["Plan", "规划"],
    loading: ["Loading the planner (Python in the browser)…", "正在加载规划器（浏览器中的 Python）……"],
  };
  const PARTS = [["weights", "#4c72b0"], ["optimizer", "#dd8452"], ["gradients", "#55a868"],
                 ["activations", "#c44e52"], ["tokens", "#8172b3"]];
  const SHAPE = ["layers", "width", "heads", "kv-heads", "mlp-width", "vocab"];
  const FLAGS = ["experts", "top-k", "devices", "nodes", "chip", "seq-len", "global-batch", "dtype",
                 "remat", "grad-accum"];
  const say = (key, arg) => TEXT[key][ZH ? 1 : 0].replace("%s", arg === undefined ? "" : arg);
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text, ns) {
    const node = ns ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function argv(form) {
    const out = [];
    const value = (name) => form.elements[name].value.trim();
    if (value("model")) out.push("--model", value("model"));
    else {
      for (const name of SHAPE) if (value(name)) out.push("--" + name, value(name));
      if (value("head-dim")) out.push("--head-dim", value("head-dim"));
      if (form.elements["tie-embeddings"].checked) out.push("--tie-embeddings");
    }
    for (const name of FLAGS) if (value(name)) out.push("--" + name, value(name));
    return out;
  }

  function renderTable(result, rows) {
    const table = $("planner-table");
    table.replaceChildren(el("caption", {}, result.title));
    const head = el("tr");
    for (const h of result.headers) head.append(el("th", {}, h));
    table.appendChild(el("thead")).append(head);
    const body = table.appendChild(el("tbody"));
    result.cells.forEach((cells, i) => {
      const tr = body.appendChild(el("tr", { class: rows[i].fits ? "fits" : "no-fit" }));
      for (const c of cells) tr.append(el("td", {}, c));
    });
  }

  function niceStep(range) {
    const raw = range / 5, power = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  }

  function renderFigure(result) {
    const rows = result.rows, left = 250, width = 520, bar = 16, gap = 6, top = 40;
    const height = top + rows.length * (bar + gap) + 40;
    const gb = 1e9, most = Math.max(result.usable_bytes, ...rows.map((r) => r.memory_bytes.total));
    const scale = (bytes) => (bytes / (most * 1.05)) * width;
    const svg = el("svg", { viewBox: `0 0 ${left + width + 20} ${height}`, role: "img",
                            "aria-label": say("axis") }, undefined, true);
    PARTS.forEach(([name, colour], i) => {
      svg.append(el("rect", { x: left + i * 100, y: 8, width: 10, height: 10, fill: colour }, undefined, true));
      svg.append(el("text", { x: left + i * 100 + 14, y: 17, "font-size": 11 }, name, true));
    });
    rows.forEach((r, i) => {
      const y = top + i * (bar + gap);
      const g = el("g", { class: "planner-bar", "data-total-bytes": r.memory_bytes.total }, undefined, true);
      g.append(el("text", { x: left - 6, y: y + bar - 4, "font-size": 11, "text-anchor": "end",
                            fill: r.fits ? "#222" : "#999" }, `${r.strategy}  ${r.mesh}`, true));
      let x = left;
      for (const [name, colour] of PARTS) {
        const w = scale(r.memory_bytes[name]);
        g.append(el("rect", { x, y, width: Math.max(w, 0), height: bar, fill: colour,
                              "fill-opacity": r.fits ? 1 : 0.35 }, undefined, true));
        x += w;
      }
      svg.append(g);
    });
    const bottom = top + rows.length * (bar + gap);
    const step = niceStep((most * 1.05) / gb);
    for (let t = 0; t * gb <= most * 1.05; t += step) {
      const x = left + scale(t * gb);
      svg.append(el("line", { x1: x, x2: x, y1: top - 4, y2: bottom, stroke: "#ddd" }, undefined, true));
      svg.append(el("text", { x, y: bottom + 14, "font-size": 10, "text-anchor": "middle" },
                    String(+t.toPrecision(6)), true));
    }
    const ux = left + scale(result.usable_bytes);
    svg.append(el("line", { x1: ux, x2: ux, y1: top - 8, y2: bottom, stroke: "#b00020",
                            "stroke-dasharray": "4 3" }, undefined, true));
    svg.append(el("text", { x: ux + 3, y: top - 10, "font-size": 10, fill: "#b00020" },
                  say("usable", (result.usable_bytes / gb).toFixed(1)), true));
    svg.append(el("text", { x: left + width / 2, y: bottom + 32, "font-size": 11,
                            "text-anchor": "middle" }, say("axis"), true));
    $("planner-figure").replaceChildren(svg);
  }

  function show(result) {
    const error = $("planner-error"), output = $("planner-output");
    error.hidden = !result.error;
    output.hidden = !!result.error;
    if (result.error) {
      error.textContent = result.error;
      return;
    }
    renderTable(result, result.rows);
    renderFigure(result);
  }

  async function start() {
    const form = $("planner-form"), status = $("planner-status");
    for (const node of document.querySelectorAll("[data-i18n]")) node.textContent = say(node.dataset.i18n);
    const shape = form.querySelector(".planner-shape");
    const toggle = () => shape.classList.toggle("off", form.elements.model.value !== "");
    form.elements.model.addEventListener("change", toggle);
    toggle();
    if (location.protocol === "file:") {
      status.textContent = say("file");
      return;
    }
    try {
      await new Promise((resolve, reject) => {
        const script = el("script", { src: BASE + "pyodide/pyodide.js" });
        script.onload = resolve;
        script.onerror = () => reject(new Error("pyodide/pyodide.js"));
        document.head.append(script);
      });
      const pyodide = await loadPyodide({ indexURL: BASE + "pyodide/" });
      const names = (await (await fetch(BASE + "py/modules.txt")).text()).split("\n").filter(Boolean);
      for (const name of names) {  // "jaxdist_lessons/planning/cli", "jaxdist_lm/run_config"
        const path = `/home/pyodide/${name}.py`;
        pyodide.FS.mkdirTree(path.slice(0, path.lastIndexOf("/")));
        const source = await (await fetch(`${BASE}py/${name}.py`)).text();
        pyodide.FS.writeFile(path, source);
      }
      const pageJson = pyodide.runPython(
        "import sys\nsys.path.insert(0, '/home/pyodide')\n" +
        "from jaxdist_lessons.planning import cli\ncli.page_json");
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const flags = argv(form);
        $("planner-command").textContent = "python -m jaxdist_lessons.planning " + flags.join(" ");
        let result;
        try {
          const py = pyodide.toPy(flags);
          result = JSON.parse(pageJson(py));
          py.destroy();
        } catch (err) {  // a bug, not bad input: the message's last line, no traceback
          result = { error: say("bug", String(err.message || err).trim().split("\n").pop()) };
        }
        show(result);
      });
      $("planner-submit").disabled = false;
      status.textContent = say("ready", pyodide.version);
      form.dataset.ready = "1";
      form.requestSubmit();
    } catch (err) {
      status.textContent = say("failed", err.message || err);
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
