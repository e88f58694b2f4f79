// Shared by the pages: the API key, WebSocket connections that come back by themselves, DOM helpers.

const KEY_STORAGE = "strata.apiKey";
const SUBPROTOCOL = "strata";

/** The API key kept in this browser ("" when none). */
export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** Subprotocols to offer: `strata`, and the key as `bearer.<base64url>` (a browser cannot set headers). */
function protocols() {
  const key = apiKey();
  return key ? [SUBPROTOCOL, `bearer.${base64url(key)}`] : [SUBPROTOCOL];
}

/** Whether the server takes the stored key (or needs none): asks an HTTP route that checks it. */
async function keyAccepted() {
  const key = apiKey();
  try {
    const response = await fetch("/v1/models", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    return response.status !== 401;
  } catch {
    return true; // the server is unreachable: retrying will tell
  }
}

/** Ask for the API key in the page's dialog; resolves true when one was saved. */
export function askKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  if (dialog.open) return Promise.resolve(false);
  if (message) document.getElementById("key-message").textContent = message;
  input.value = apiKey();
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const saved = dialog.returnValue === "save";
        if (saved) localStorage.setItem(KEY_STORAGE, input.value.trim());
        dialog.returnValue = "";
        resolve(saved);
      },
      { once: true },
    );
    dialog.showModal();
    input.focus();
  });
}

/** Show the connection's state in the header. */
function showConnection(state, text) {
  const status = document.getElementById("connection");
  status.dataset.state = state;
  status.textContent = text;
}

/**
 * A WebSocket to this server that reconnects after a drop (backing off up to 5 s) and, when the server
 * refuses it for want of a valid API key, asks for the key first.
 */
export class LiveSocket {
  constructor(path, { onMessage, onOpen = () => {}, onClose = () => {} }) {
    this.path = path;
    this.onMessage = onMessage;
    this.onOpen = onOpen;
    this.onClose = onClose;
    this.delay = 500;
    this.socket = null;
    this.timer = null;
    document.getElementById("key-button").addEventListener("click", async () => {
      if (await askKey("Enter the server's API key. It is kept in this browser's local storage.")) {
        this.restart();
      }
    });
  }

  /** Connect (asking for the key first when the server needs one and none is stored). */
  async start() {
    if (document.body.dataset.authRequired === "true" && !apiKey()) {
      await askKey();
    }
    this.connect();
  }

  /** Drop the connection and open a new one now (after the key changed). */
  restart() {
    clearTimeout(this.timer);
    if (this.socket) {
      this.socket.onclose = null;
      this.socket.close();
      this.onClose();
    }
    this.connect();
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}${this.path}`, protocols());
    let opened = false;
    this.socket = socket;
    showConnection("connecting", "Connecting…");
    socket.onopen = () => {
      opened = true;
      this.delay = 500;
      showConnection("open", "Connected");
      this.onOpen();
    };
    socket.onmessage = (event) => this.onMessage(JSON.parse(event.data));
    socket.onclose = async () => {
      this.socket = null;
      if (opened) this.onClose();
      showConnection("closed", "Disconnected, retrying…");
      if (!opened && !(await keyAccepted())) {
        showConnection("closed", "API key needed");
        const message = apiKey() ? "The server refused this API key. Enter the right one." : undefined;
        if (!(await askKey(message))) return;
        this.delay = 0;
      }
      this.timer = setTimeout(() => this.connect(), this.delay);
      this.delay = Math.min(this.delay * 2 || 500, 5000);
    };
  }

  /** Send a JSON message; false when the connection is not open. */
  send(message) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(message));
    return true;
  }
}

/** Make an element: `props` sets attributes (`class`, `text` and `dataset` are shorthands). */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children);
  return node;
}

/** Copy text to the clipboard (falls back to a hidden text area outside secure contexts). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = el("textarea", { class: "offscreen", "aria-hidden": "true" });
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

/** A copy button that says "Copied" for a moment. */
export function copyButton(label, getText, accessibleName) {
  const button = el("button", { type: "button", class: "quiet small", "aria-label": accessibleName, text: label });
  button.addEventListener("click", async () => {
    try {
      await copyText(getText());
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = label), 1500);
  });
  return button;
}

/** Bytes as GiB/MiB with one decimal. */
export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const gib = bytes / 2 ** 30;
  return gib >= 1 ? `${gib.toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(0)} MiB`;
}

/** A horizontal bar with ARIA meter semantics; update it with `setBar`. */
export function bar(label) {
  const fill = el("span", { class: "fill" });
  return el("span", { class: "bar", role: "meter", "aria-label": label, "aria-valuemin": "0" }, fill);
}

/** Set a bar's value out of `max` (the text is what assistive technology reads). */
export function setBar(node, value, max, text) {
  const share = max > 0 ? Math.min(1, Math.max(0, value / max)) : 0;
  node.firstChild.style.width = `${(share * 100).toFixed(1)}%`;
  node.setAttribute("aria-valuemax", String(max));
  node.setAttribute("aria-valuenow", String(value));
  node.setAttribute("aria-valuetext", text);
  node.dataset.level = share > 0.9 ? "high" : share > 0.7 ? "mid" : "low";
}

/** A CSS custom property of the page (colours for canvases). */
export function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}
