// The throughput chart: aggregate tokens per second over the last minutes, drawn on a canvas.

import { cssVar } from "./common.js";

const GAP_S = 5; // points further apart than this (nobody was watching) are not joined

function niceMax(value) {
  if (value <= 0) return 10;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) {
    if (step * power >= value) return step * power;
  }
  return 10 * power;
}

/** Draw `points` ([time_s, tok_s] pairs) over the `span_s` seconds up to `now`. */
export function drawChart(canvas, points, now, spanS) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  const left = 48;
  const right = 8;
  const top = 10;
  const bottom = 22;
  const plotWidth = width - left - right;
  const plotHeight = height - top - bottom;
  const visible = points.filter(([time]) => time >= now - spanS);
  const max = niceMax(Math.max(0, ...visible.map(([, value]) => value)));
  const x = (time) => left + ((time - (now - spanS)) / spanS) * plotWidth;
  const y = (value) => top + plotHeight - (value / max) * plotHeight;

  context.font = "12px system-ui, sans-serif";
  context.fillStyle = cssVar("--muted");
  context.strokeStyle = cssVar("--grid");
  context.lineWidth = 1;
  context.textAlign = "right";
  context.textBaseline = "middle";
  for (let step = 0; step <= 4; step += 1) {
    const value = (max * step) / 4;
    context.beginPath();
    context.moveTo(left, Math.round(y(value)) + 0.5);
    context.lineTo(width - right, Math.round(y(value)) + 0.5);
    context.stroke();
    context.fillText(String(Math.round(value * 10) / 10), left - 6, y(value));
  }
  context.textBaseline = "top";
  const oldest = Math.floor(spanS / 60);
  for (let minutes = oldest; minutes >= 0; minutes -= 1) {
    context.textAlign = minutes === 0 ? "right" : minutes === oldest ? "left" : "center";
    context.fillText(minutes ? `−${minutes} min` : "now", x(now - minutes * 60), top + plotHeight + 6);
  }

  context.strokeStyle = cssVar("--accent");
  context.fillStyle = cssVar("--accent-soft");
  context.lineWidth = 2;
  let run = [];
  const flush = () => {
    if (run.length === 0) return;
    context.beginPath();
    context.moveTo(x(run[0][0]), y(0));
    for (const [time, value] of run) context.lineTo(x(time), y(value));
    context.lineTo(x(run[run.length - 1][0]), y(0));
    context.closePath();
    context.fill();
    context.beginPath();
    run.forEach(([time, value], index) => (index ? context.lineTo(x(time), y(value)) : context.moveTo(x(time), y(value))));
    context.stroke();
    run = [];
  };
  for (const point of visible) {
    if (run.length && point[0] - run[run.length - 1][0] > GAP_S) flush();
    run.push(point);
  }
  flush();
}
