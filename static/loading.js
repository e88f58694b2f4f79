// The loading page: polls /health until the engine serves, then shows the page that was asked for.

const POLL_MS = 500;

const message = document.getElementById("load-message");
const meter = document.getElementById("load-bar");
const connection = document.getElementById("connection");

function fill(percent) {
  meter.setAttribute("aria-valuenow", String(percent));
  meter.firstElementChild.style.width = `${percent}%`;
}

function show(state) {
  message.textContent = state.message;
  fill(Math.round(100 * (state.share || 0)));
  meter.dataset.state = state.status;
  connection.dataset.state = state.status === "failed" ? "closed" : "connecting";
  connection.textContent = state.status === "failed" ? "Failed" : "Loading…";
}

fill(Number(meter.getAttribute("aria-valuenow")));
connection.textContent = "Loading…";
document.getElementById("key-button").hidden = true;

async function poll() {
  try {
    const response = await fetch("/health", { cache: "no-store" });
    if (response.status === 200) {
      window.location.reload();
      return;
    }
    const state = await response.json();
    show(state);
    if (state.status === "failed") return;
  } catch {
    message.textContent = "The server is not answering; trying again…";
  }
  setTimeout(poll, POLL_MS);
}

setTimeout(poll, POLL_MS);
