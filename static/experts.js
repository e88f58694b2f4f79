// The expert residency grid: one row per MoE layer, one cell per expert, coloured by where the expert
// lives (GPU memory or host RAM) and shaded by its share of the layer's recent routing. A canvas, so that
// thousands of cells stay cheap; the pointer or the arrow keys pick a cell to read out.

import { cssVar } from "./common.js";

const LABEL_WIDTH = 34;

function decode(base64) {
  return Uint8Array.from(atob(base64), (char) => char.charCodeAt(0));
}

function rgb(hex) {
  const value = parseInt(hex.replace("#", ""), 16);
  return [(value >> 16) & 255, (value >> 8) & 255, value & 255];
}

export class ExpertGrid {
  constructor(canvas, readout, empty, spanLabel) {
    this.canvas = canvas;
    this.readout = readout;
    this.empty = empty;
    this.spanLabel = spanLabel;
    this.grid = null;
    this.cursor = null; // [row, expert] picked by pointer or keys
    canvas.tabIndex = 0;
    canvas.addEventListener("mousemove", (event) => this.pick(this.cellAt(event)));
    canvas.addEventListener("mouseleave", () => this.pick(null));
    canvas.addEventListener("keydown", (event) => this.key(event));
    canvas.addEventListener("focus", () => this.pick(this.cursor ?? [0, 0]));
    window.addEventListener("resize", () => this.draw());
  }

  /** Take a new grid from a frame (null: no routing report yet). */
  update(grid) {
    if (grid) {
      grid.locationRows = grid.location.map(decode);
      grid.heatRows = grid.heat.map(decode);
      this.spanLabel.textContent = String(grid.span_s);
    }
    this.grid = grid;
    this.empty.hidden = Boolean(grid);
    this.canvas.hidden = !grid;
    if (!grid) return;
    this.canvas.dataset.layers = String(grid.layers.length);
    this.canvas.dataset.experts = String(grid.experts);
    const inRam = grid.locationRows.reduce((sum, row) => sum + row.reduce((a, b) => a + (b === 1), 0), 0);
    const cells = grid.layers.length * grid.experts;
    this.canvas.setAttribute(
      "aria-label",
      `Expert residency: ${grid.layers.length} layers × ${grid.experts} experts; ` +
        `${cells - inRam} in GPU memory, ${inRam} in host RAM. Arrow keys read single experts.`,
    );
    this.draw();
    if (this.cursor) this.pick(this.cursor);
  }

  layout() {
    const grid = this.grid;
    const width = this.canvas.parentElement.clientWidth - 2;
    const cell = Math.max(3, Math.min(18, Math.floor((width - LABEL_WIDTH) / grid.experts)));
    return { cell, width: LABEL_WIDTH + cell * grid.experts, height: cell * grid.layers.length };
  }

  draw() {
    const grid = this.grid;
    if (!grid) return;
    const { cell, width, height } = this.layout();
    const ratio = window.devicePixelRatio || 1;
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(width * ratio);
    this.canvas.height = Math.round(height * ratio);
    const context = this.canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    const background = rgb(cssVar("--panel"));
    const colours = [rgb(cssVar("--gpu")), rgb(cssVar("--ram"))];
    const gap = cell >= 6 ? 1 : 0;
    context.font = `${Math.min(11, cell)}px system-ui, sans-serif`;
    context.textAlign = "right";
    context.textBaseline = "middle";
    const labelEvery = Math.ceil(12 / cell);
    grid.layers.forEach((layer, row) => {
      if (row % labelEvery === 0) {
        context.fillStyle = cssVar("--muted");
        context.fillText(String(layer), LABEL_WIDTH - 6, row * cell + cell / 2);
      }
      const where = grid.locationRows[row];
      const heat = grid.heatRows[row];
      for (let expert = 0; expert < grid.experts; expert += 1) {
        const colour = colours[where[expert]] ?? colours[1];
        const strength = 0.18 + 0.82 * Math.sqrt(heat[expert] / 255);
        const mix = colour.map((channel, i) => Math.round(background[i] + (channel - background[i]) * strength));
        context.fillStyle = `rgb(${mix.join(",")})`;
        context.fillRect(LABEL_WIDTH + expert * cell, row * cell, cell - gap, cell - gap);
      }
    });
    if (this.cursor && document.activeElement === this.canvas) {
      const [row, expert] = this.cursor;
      context.strokeStyle = cssVar("--text");
      context.lineWidth = 2;
      context.strokeRect(LABEL_WIDTH + expert * cell + 1, row * cell + 1, cell - 2, cell - 2);
    }
  }

  cellAt(event) {
    if (!this.grid) return null;
    const { cell } = this.layout();
    const bounds = this.canvas.getBoundingClientRect();
    const expert = Math.floor((event.clientX - bounds.left - LABEL_WIDTH) / cell);
    const row = Math.floor((event.clientY - bounds.top) / cell);
    const inside = expert >= 0 && expert < this.grid.experts && row >= 0 && row < this.grid.layers.length;
    return inside ? [row, expert] : null;
  }

  key(event) {
    if (!this.grid) return;
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    const move = moves[event.key];
    if (!move) return;
    event.preventDefault();
    const [row, expert] = this.cursor ?? [0, 0];
    const rows = this.grid.layers.length;
    this.pick([
      Math.min(rows - 1, Math.max(0, row + move[0])),
      Math.min(this.grid.experts - 1, Math.max(0, expert + move[1])),
    ]);
  }

  pick(cell) {
    const grid = this.grid;
    if (cell) this.cursor = cell;
    if (!grid || !cell) {
      this.readout.textContent = "";
      this.draw();
      return;
    }
    const [row, expert] = cell;
    const where = grid.locationRows[row][expert] === 0 ? "GPU memory" : "host RAM";
    const share = (grid.heatRows[row][expert] / 255) * grid.max_share * 100;
    this.readout.textContent =
      `Layer ${grid.layers[row]}, expert ${expert}: in ${where}, ` +
      `${share.toFixed(1)} % of the layer's routing over the last ${grid.span_s} s`;
    this.draw();
  }
}
