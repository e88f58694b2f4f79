// The Monitor page: slots, queue, throughput, GPUs, host and expert residency, pushed over /ws/monitor.

import { drawChart } from "./chart.js";
import { LiveSocket, bar, el, formatBytes, setBar } from "./common.js";
import { ExpertGrid } from "./experts.js";

const $ = (id) => document.getElementById(id);
const STATES = { idle: "idle", prompt: "reading prompt", decode: "decoding" };

const chart = $("tok-chart");
const experts = new ExpertGrid($("experts"), $("expert-readout"), $("experts-empty"), $("heat-span"));
const kvMeter = bar("KV cache usage");
$("kv-meter").replaceWith(kvMeter);
let history = [];
let last = null;

// ---- slots

const slotViews = [];

function slotView(index) {
  const state = el("span", { class: "badge" });
  const grammar = el("span", { class: "grammar-mark", text: "grammar", title: "Its output follows a grammar" });
  const progress = bar(`Slot ${index} prompt read`);
  progress.setAttribute("role", "progressbar");
  const progressText = el("span", { class: "small-text" });
  const output = el("dd");
  const speed = el("dd");
  const perWindow = el("dd");
  const contextText = el("span", { class: "small-text" });
  const context = bar(`Slot ${index} context used`);
  const item = el(
    "li",
    { class: "slot" },
    el("div", { class: "slot-head" }, el("h3", { text: `Slot ${index}` }), grammar, state),
    el("div", { class: "prompt-progress" }, el("span", { class: "label", text: "Prompt" }), progress, progressText),
    el(
      "dl",
      { class: "slot-figures" },
      el("div", {}, el("dt", { text: "Generated" }), output),
      el("div", {}, el("dt", { text: "tok/s" }), speed),
      el("div", {}, el("dt", { text: "tok/window" }), perWindow),
    ),
    el("div", { class: "context" }, el("span", { class: "label", text: "Context" }), context, contextText),
  );
  return { item, state, grammar, progress, progressText, output, speed, perWindow, context, contextText };
}

function renderSlots(slots, maxModelLen) {
  const list = $("slots");
  while (slotViews.length < slots.length) {
    const view = slotView(slotViews.length);
    slotViews.push(view);
    list.append(view.item);
  }
  slots.forEach((slot, index) => {
    const view = slotViews[index];
    view.item.dataset.state = slot.state;
    view.item.dataset.busy = slot.state === "idle" ? "false" : "true";
    view.state.textContent = STATES[slot.state] ?? slot.state;
    view.grammar.hidden = !slot.grammar || slot.state === "idle";
    const reading = slot.state === "prompt";
    view.progress.parentElement.hidden = !reading;
    if (reading) {
      const text = `${slot.prompt_tokens} / ${slot.prompt_total}`;
      setBar(view.progress, slot.prompt_tokens, slot.prompt_total, `${text} prompt tokens read`);
      view.progressText.textContent = text;
    }
    view.output.textContent = slot.state === "idle" ? "–" : String(slot.output_tokens);
    view.speed.textContent = slot.state === "idle" ? "–" : slot.tok_s.toFixed(1);
    view.perWindow.textContent = slot.tokens_per_window ? slot.tokens_per_window.toFixed(2) : "–";
    const contextText = `${slot.context_tokens} / ${maxModelLen}`;
    setBar(view.context, slot.context_tokens, maxModelLen, `${contextText} tokens`);
    view.contextText.textContent = contextText;
  });
}

// ---- GPUs and host

function card(title, rows) {
  const body = el("dl", { class: "card-figures" });
  for (const [label, text, meter] of rows) {
    body.append(el("div", {}, el("dt", { text: label }), el("dd", {}, el("span", { text }), meter ?? "")));
  }
  return el("article", { class: "card" }, el("h3", { text: title }), body);
}

function meter(label, value, max, text) {
  const node = bar(label);
  setBar(node, value ?? 0, max ?? 0, text);
  return node;
}

function renderGpus(gpus) {
  const panel = $("gpus");
  if (gpus.cards.length === 0) {
    const note = el("p", { class: "empty", text: gpus.message });
    if (gpus.detail) note.append(el("span", { class: "small-text", text: ` (${gpus.detail})` }));
    panel.replaceChildren(note);
    return;
  }
  panel.replaceChildren(
    ...gpus.cards.map((gpu) => {
      const memory = `${formatBytes(gpu.memory_used)} / ${formatBytes(gpu.memory_total)}`;
      const util = gpu.utilization === null ? "–" : `${gpu.utilization} %`;
      const power =
        gpu.power_w === null
          ? "–"
          : `${gpu.power_w.toFixed(0)} W${gpu.power_limit_w ? ` / ${gpu.power_limit_w.toFixed(0)} W` : ""}`;
      const rows = [
        ["Utilisation", util, meter(`GPU ${gpu.index} utilisation`, gpu.utilization, 100, util)],
        ["VRAM", memory, meter(`GPU ${gpu.index} memory`, gpu.memory_used, gpu.memory_total, memory)],
        ["Power", power, meter(`GPU ${gpu.index} power`, gpu.power_w, gpu.power_limit_w, power)],
      ];
      if (gpu.temperature_c !== null) rows.push(["Temperature", `${gpu.temperature_c} °C`]);
      return card(`GPU ${gpu.index} · ${gpu.name ?? "unknown"}`, rows);
    }),
  );
}

function renderStages(stages) {
  $("stages-panel").hidden = stages.length === 0;
  $("stages").replaceChildren(
    ...stages.map((stage) => {
      const busy = `${(100 * stage.busy_share).toFixed(0)} %`;
      const wait = `${(100 * stage.wait_share).toFixed(0)} %`;
      return card(`Stage ${stage.stage}`, [
        ["Busy", busy, meter(`Stage ${stage.stage} busy`, stage.busy_share, 1, busy)],
        ["Waiting", wait, meter(`Stage ${stage.stage} waiting`, stage.wait_share, 1, wait)],
      ]);
    }),
  );
}

function renderHost(host) {
  const cpu = `${host.cpu_percent.toFixed(0)} % of ${host.cpu_count} cores`;
  const ram = `${formatBytes(host.ram_used)} / ${formatBytes(host.ram_total)}`;
  const rows = [
    ["CPU", cpu, meter("Host CPU", host.cpu_percent, 100, cpu)],
    ["RAM", ram, meter("Host RAM", host.ram_used, host.ram_total, ram)],
  ];
  if (host.engine_rss !== null) rows.push(["Engine process", formatBytes(host.engine_rss)]);
  $("host").replaceChildren(card("This machine", rows));
}

// ---- frames

function onFrame(frame) {
  last = frame;
  const metrics = frame.metrics;
  if (frame.history) history = frame.history;
  else if (frame.point) history.push(frame.point);
  history = history.filter(([time]) => time >= frame.time - frame.history_s);
  $("running").textContent = `${metrics.num_requests_running} / ${metrics.parallel}`;
  $("waiting").textContent = String(metrics.num_requests_waiting);
  $("live-tok-s").textContent = metrics.live_tok_s.toFixed(1);
  const reads = metrics.kv_vram_block_reads_total + metrics.kv_host_block_reads_total;
  // only a pool partly in host RAM (--kv-resident) reads blocks from two places
  const fromVram = metrics.kv_host_block_reads_total
    ? ` · ${((100 * metrics.kv_vram_block_reads_total) / reads).toFixed(1)} % of block reads from VRAM`
    : "";
  const usage = `${(metrics.kv_cache_usage_perc * 100).toFixed(1)} % of ${metrics.kv_blocks_total} blocks`;
  const kv = usage + fromVram;
  $("kv-text").textContent = kv;
  setBar(kvMeter, metrics.kv_blocks_used, metrics.kv_blocks_total, kv);
  const queried = metrics.prefix_cache_queries_total;
  $("prefix-cache").textContent = queried
    ? `${((100 * metrics.prefix_cache_hits_total) / queried).toFixed(1)} % of ${queried} prompt tokens reused`
    : "no prompts yet";
  $("parked").textContent =
    `${metrics.parked_conversations_ram} in RAM (${formatBytes(metrics.parked_bytes_ram)}) · ` +
    `${metrics.parked_conversations_disk} on disk · ${metrics.park_restores_total} restored`;
  const engine = frame.engine;
  $("device").textContent = engine.dead ? `stopped: ${engine.dead}` : `${engine.device} · ${engine.backends}`;
  renderSlots(metrics.slots, engine.max_model_len);
  renderGpus(frame.gpus);
  renderStages(frame.stages);
  renderHost(frame.host);
  if ("experts" in frame) experts.update(frame.experts);
  drawChart(chart, history, frame.time, frame.history_s);
}

window.addEventListener("resize", () => last && drawChart(chart, history, last.time, last.history_s));

new LiveSocket("/ws/monitor", { onMessage: onFrame }).start();
