// The chat page: conversations kept in local storage, answers streamed over /ws/chat.

import { LiveSocket, copyButton, el } from "./common.js";
import { renderAnswer } from "./markdown.js";

const STORE = "strata.conversations";
const CURRENT = "strata.currentConversation";
const SETTINGS = "strata.settings";
const DEFAULTS = { temperature: 0.7, top_p: 1, max_tokens: 512, system: "" };
const SAVE_EVERY_MS = 1000;

const $ = (id) => document.getElementById(id);
const messagesView = $("messages");
const prompt = $("prompt");
const sendButton = $("send");
const stopButton = $("stop");
const emptyNote = $("empty-chat").textContent;

let conversations = load(STORE, []);
let currentId = localStorage.getItem(CURRENT);
const streaming = new Map(); // answer id -> { conversation, message }
let lastSave = 0;
let renderQueued = new Set();

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  lastSave = Date.now();
}

function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
}

function current() {
  return conversations.find((conversation) => conversation.id === currentId) ?? null;
}

// ---- settings panel

function readSettings() {
  const stored = { ...DEFAULTS, ...load(SETTINGS, {}) };
  for (const name of Object.keys(DEFAULTS)) $(name).value = stored[name];
}

function number(name, parse) {
  const value = parse($(name).value);
  return Number.isFinite(value) ? value : DEFAULTS[name];
}

function settings() {
  return {
    temperature: number("temperature", parseFloat),
    top_p: number("top_p", parseFloat),
    max_tokens: number("max_tokens", (text) => parseInt(text, 10)),
    system: $("system").value,
  };
}

$("settings").addEventListener("input", () => localStorage.setItem(SETTINGS, JSON.stringify(settings())));
$("settings").addEventListener("submit", (event) => event.preventDefault());
$("reset-settings").addEventListener("click", () => {
  localStorage.removeItem(SETTINGS);
  readSettings();
});

// ---- conversation list

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of conversations) {
    const select = el("button", {
      type: "button",
      class: "conversation",
      "aria-current": conversation.id === currentId ? "true" : undefined,
      text: conversation.title,
    });
    select.addEventListener("click", () => open(conversation.id));
    const remove = el("button", {
      type: "button",
      class: "quiet small remove",
      "aria-label": `Delete conversation “${conversation.title}”`,
      text: "✕",
    });
    remove.addEventListener("click", () => removeConversation(conversation.id));
    list.append(el("li", {}, select, remove));
  }
}

function open(id) {
  currentId = id;
  if (id) localStorage.setItem(CURRENT, id);
  else localStorage.removeItem(CURRENT);
  renderList();
  renderMessages();
  prompt.focus();
}

function removeConversation(id) {
  for (const [answerId, entry] of streaming) {
    if (entry.conversation.id === id) stop(answerId);
  }
  conversations = conversations.filter((conversation) => conversation.id !== id);
  save();
  open(currentId === id ? null : currentId);
}

// ---- messages

function statusText(message) {
  if (message.status === "streaming") return "Generating…";
  if (message.status === "error") return `Error: ${message.error}`;
  if (message.status === "interrupted") return "Interrupted: the connection was lost";
  const parts = [];
  const stats = message.stats ?? {};
  if (stats.ttft_s !== null && stats.ttft_s !== undefined) parts.push(`first token ${stats.ttft_s.toFixed(2)} s`);
  if (stats.tok_s !== null && stats.tok_s !== undefined) parts.push(`${stats.tok_s.toFixed(1)} tok/s`);
  if (stats.usage) parts.push(`${stats.usage.completion_tokens} tokens`);
  if (message.status === "stopped") parts.push("stopped");
  else if (stats.finish_reason === "length") parts.push("reached max tokens");
  return parts.join(" · ");
}

// An answer's parts: its reasoning (a thinking model's, collapsed), its content, the tools it called.
function answerParts(message) {
  const parts = [];
  if (message.reasoning) {
    const open = message.status === "streaming" && !message.content;
    const details = el(
      "details",
      { class: "reasoning" },
      el("summary", { text: open ? "Reasoning…" : "Reasoning" }),
      el("p", { class: "reasoning-text", text: message.reasoning }),
    );
    parts.push(details);
  }
  parts.push(renderAnswer(message.content));
  for (const call of message.tool_calls ?? []) {
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch {
      // shown as the model wrote it
    }
    parts.push(
      el(
        "section",
        { class: "tool-call", "aria-label": `Tool call ${call.name}` },
        el("h4", {}, el("span", { class: "label", text: "Tool call" }), el("code", { text: call.name })),
        el("pre", {}, el("code", { text: args })),
      ),
    );
  }
  return parts;
}

function messageView(message) {
  const assistant = message.role === "assistant";
  const body = el("div", { class: "body" });
  if (assistant) {
    body.setAttribute("aria-live", "polite");
    body.append(...answerParts(message));
  } else {
    body.append(el("p", { text: message.content }));
  }
  const article = el(
    "article",
    { class: `message ${message.role}`, dataset: { id: message.id ?? "", status: message.status ?? "" } },
    el("h3", { class: "author", text: assistant ? "Strata" : "You" }),
    body,
  );
  if (assistant) {
    body.setAttribute("aria-busy", message.status === "streaming" ? "true" : "false");
    const footer = el("footer", { class: "meta" }, el("span", { class: "stats", text: statusText(message) }));
    footer.append(copyButton("Copy", () => message.content, "Copy answer"));
    article.append(footer);
  }
  return article;
}

function renderMessages() {
  const conversation = current();
  messagesView.replaceChildren();
  if (!conversation || conversation.messages.length === 0) {
    messagesView.append(el("p", { class: "empty", text: emptyNote }));
  } else {
    for (const message of conversation.messages) messagesView.append(messageView(message));
  }
  messagesView.scrollTop = messagesView.scrollHeight;
  updateButtons();
}

function refresh(message) {
  const view = messagesView.querySelector(`article[data-id="${CSS.escape(message.id)}"]`);
  if (!view) return;
  const atBottom = messagesView.scrollHeight - messagesView.scrollTop - messagesView.clientHeight < 40;
  view.dataset.status = message.status;
  const body = view.querySelector(".body");
  const wasOpen = body.querySelector("details.reasoning")?.open ?? false;
  body.replaceChildren(...answerParts(message));
  const reasoning = body.querySelector("details.reasoning");
  if (reasoning) reasoning.open = wasOpen;
  body.setAttribute("aria-busy", message.status === "streaming" ? "true" : "false");
  view.querySelector(".stats").textContent = statusText(message);
  if (atBottom) messagesView.scrollTop = messagesView.scrollHeight;
}

function scheduleRefresh(message) {
  if (renderQueued.size === 0) {
    requestAnimationFrame(() => {
      const queued = renderQueued;
      renderQueued = new Set();
      for (const entry of queued) refresh(entry);
    });
  }
  renderQueued.add(message);
}

function updateButtons() {
  const busy = streaming.size > 0;
  if (!busy && document.activeElement === stopButton) prompt.focus();
  sendButton.disabled = busy;
  stopButton.disabled = !busy;
}

// ---- talking to the server

function send() {
  const text = prompt.value.trim();
  if (!text || streaming.size > 0) return;
  let conversation = current();
  if (!conversation) {
    conversation = { id: newId(), title: text.slice(0, 48), messages: [] };
    conversations.unshift(conversation);
    currentId = conversation.id;
    localStorage.setItem(CURRENT, currentId);
  }
  const chosen = settings();
  const history = chosen.system.trim() ? [{ role: "system", content: chosen.system }] : [];
  for (const message of conversation.messages) {
    if (message.role === "user" || message.content) history.push({ role: message.role, content: message.content });
  }
  history.push({ role: "user", content: text });
  conversation.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", id: newId(), content: "", status: "streaming" };
  conversation.messages.push(answer);
  conversations = [conversation, ...conversations.filter((other) => other !== conversation)];
  prompt.value = "";
  const params = { temperature: chosen.temperature, top_p: chosen.top_p, max_tokens: chosen.max_tokens };
  if (socket.send({ type: "chat", id: answer.id, messages: history, params })) {
    streaming.set(answer.id, { conversation, message: answer });
  } else {
    Object.assign(answer, { status: "error", error: "not connected to the server" });
  }
  save();
  renderList();
  renderMessages();
  prompt.focus();
}

function stop(answerId) {
  for (const id of answerId ? [answerId] : streaming.keys()) socket.send({ type: "stop", id });
}

function finish(id, update) {
  const entry = streaming.get(id);
  if (!entry) return;
  streaming.delete(id);
  Object.assign(entry.message, update);
  save();
  scheduleRefresh(entry.message);
  updateButtons();
}

function onMessage(message) {
  if (message.type === "delta") {
    const entry = streaming.get(message.id);
    if (!entry) return;
    entry.message.content += message.text;
    scheduleRefresh(entry.message);
    if (Date.now() - lastSave > SAVE_EVERY_MS) save();
  } else if (message.type === "reasoning" || message.type === "tool_call") {
    const entry = streaming.get(message.id);
    if (!entry) return;
    if (message.type === "reasoning") entry.message.reasoning = (entry.message.reasoning ?? "") + message.text;
    else entry.message.tool_calls = [...(entry.message.tool_calls ?? []), message.call];
    scheduleRefresh(entry.message);
  } else if (message.type === "done") {
    const stats = {
      ttft_s: message.ttft_s,
      tok_s: message.tok_s,
      usage: message.usage,
      finish_reason: message.finish_reason,
    };
    finish(message.id, { status: message.finish_reason === "abort" ? "stopped" : "done", stats });
  } else if (message.type === "error") {
    finish(message.id, { status: "error", error: message.message });
  }
}

function onClose() {
  for (const id of [...streaming.keys()]) finish(id, { status: "interrupted" });
}

const socket = new LiveSocket("/ws/chat", { onMessage, onClose });

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  } else if (event.key === "Escape" && streaming.size > 0) {
    event.preventDefault();
    stop();
  }
});
stopButton.addEventListener("click", () => stop());
$("new-chat").addEventListener("click", () => open(null));

for (const conversation of conversations) {
  for (const message of conversation.messages) {
    if (message.status === "streaming") message.status = "interrupted";
  }
}
if (!current()) currentId = null;
readSettings();
renderList();
renderMessages();
socket.start();
