// Model text to DOM: ``` fences become <pre><code> blocks, `spans` become <code>, the rest paragraphs.
// Every piece of model text lands in a text node, so nothing it contains is ever parsed as HTML.

import { copyButton, el } from "./common.js";

const FENCE = /^\s*```(.*)$/;
const FENCE_END = /^\s*```\s*$/;
const INLINE_CODE = /`([^`\n]+)`/g;

function inline(text) {
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(INLINE_CODE)) {
    if (match.index > last) nodes.push(text.slice(last, match.index));
    nodes.push(el("code", { text: match[1] }));
    last = match.index + match[0].length;
  }
  if (last < text.length) nodes.push(text.slice(last));
  return nodes;
}

function paragraphs(text, into) {
  for (const block of text.split(/\n{2,}/)) {
    if (block.trim()) into.append(el("p", {}, ...inline(block)));
  }
}

function codeBlock(code, language) {
  const head = el("div", { class: "code-head" }, el("span", { text: language || "code" }));
  head.append(copyButton("Copy code", () => code, language ? `Copy ${language} code` : "Copy code"));
  return el("div", { class: "code-block" }, head, el("pre", {}, el("code", { text: code })));
}

/** The DOM of an answer (an unclosed fence, as while streaming, runs to the end). */
export function renderAnswer(text) {
  const fragment = document.createDocumentFragment();
  const lines = text.split("\n");
  let prose = [];
  let index = 0;
  while (index < lines.length) {
    const fence = lines[index].match(FENCE);
    if (!fence) {
      prose.push(lines[index]);
      index += 1;
      continue;
    }
    paragraphs(prose.join("\n"), fragment);
    prose = [];
    const code = [];
    index += 1;
    while (index < lines.length && !FENCE_END.test(lines[index])) {
      code.push(lines[index]);
      index += 1;
    }
    index += 1;
    fragment.append(codeBlock(code.join("\n"), fence[1].trim().split(/\s+/)[0]));
  }
  paragraphs(prose.join("\n"), fragment);
  return fragment;
}
