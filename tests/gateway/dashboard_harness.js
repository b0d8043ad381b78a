// Runs the dashboard's script in Node, without a browser: a stand-in DOM (canvases draw
// nothing) and a fetch that answers /metrics with the scripted bodies, one per poll, 20 s
// apart. Prints what the page shows: {"pools": header text, "advice": advice text, "points":
// {canvas id: points its chart drew}}.
// Usage: node dashboard_harness.js dashboard.js scrapes.json
"use strict";
const fs = require("fs");
const vm = require("vm");

const [scriptPath, scrapesPath] = process.argv.slice(2);
const scrapes = JSON.parse(fs.readFileSync(scrapesPath, "utf8"));
const elements = {};
const drawing = new Proxy({}, { get: () => () => {}, set: () => true });
function element(id) {
  if (!elements[id]) {
    elements[id] = {
      id, textContent: "", className: "", hidden: true, dataset: {},
      children: [],
      set innerHTML(html) { this.children = []; }, // the script only ever clears it
      appendChild(child) { this.children.push(child); },
      addEventListener() {},
      getContext: () => drawing,
      width: 560, height: 220,
    };
  }
  return elements[id];
}
let scrape = 0;
let now = 1_000_000;
const context = {
  document: { getElementById: element, createElement: () => ({ textContent: "", className: "" }) },
  sessionStorage: { getItem: () => "", setItem() {} },
  fetch: async () => {
    const body = scrapes[Math.min(scrape++, scrapes.length - 1)];
    return { status: 200, ok: true, text: async () => body };
  },
  Date: class extends Date { static now() { return (now += 20_000); } },
  setInterval: () => {},
  console,
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(scriptPath, "utf8") + "\nthis.poll = poll;", context);
(async () => {
  for (let i = 1; i < scrapes.length; i++) await context.poll(); // the script polled once
  const advice = element("advice").children.map((c) => c.textContent).join(" ");
  const points = {};
  for (const [id, el] of Object.entries(elements))
    if (el.dataset.points !== undefined) points[id] = Number(el.dataset.points);
  process.stdout.write(JSON.stringify({ pools: element("pools").textContent, advice, points }));
})();
