// The console's plots. Their numbers come from each plot's data-series attribute (JSON, escaped by the template
// like any attribute) and are drawn on canvas by uPlot: no markup is built from data here.
(function () {
  "use strict";

  function fmt(v) {
    if (v == null) return "";
    if (v >= 100) return v.toFixed(0);
    if (v >= 1) return v.toPrecision(3);
    return v.toPrecision(2);
  }

  const COLORS = { eager: "#868e96", plain: "#3b5bdb", "CUDA graph": "#2b8a3e" };

  function latency(el, boxes) {
    const xs = boxes.map((_, i) => i);
    const lo = Math.min(...boxes.map((b) => b.min || b.median));
    const hi = Math.max(...boxes.map((b) => b.max || b.median));
    // A log scale's range on whole decades: uPlot's log splits threw "Invalid array length" on some other ranges
    // (one box from 0.0156 to 0.276 ms, say), and the plot was not drawn (tests/ui/test_console_plot_ranges.py).
    const decade = (v, round) => 10 ** round(Math.log10(v));
    const label = (i) => (boxes[i] ? boxes[i].point + " · " + boxes[i].figure : "");
    const opts = {
      width: el.clientWidth, height: 280,
      scales: { x: { time: false, range: [-0.6, boxes.length - 0.4] }, y: { distr: 3, range: [decade(lo / 1.6, Math.floor), decade(hi * 1.6, Math.ceil)] } },
      axes: [
        { splits: () => xs, values: (u, splits) => splits.map(label), grid: { show: false }, size: 40 },
        { label: "ms (log)", values: (u, splits) => splits.map(fmt), size: 56 },
      ],
      series: [{}, { label: "median", stroke: "rgba(0,0,0,0)", points: { show: false } }],
      legend: { show: false },
      cursor: { show: false },
      hooks: {
        draw: [(u) => {
          const ctx = u.ctx, px = uPlot.pxRatio;
          const step = Math.abs(u.valToPos(1, "x", true) - u.valToPos(0, "x", true));
          const half = Math.min(step * 0.28, 60 * px);
          ctx.save();
          boxes.forEach((b, i) => {
            const cx = u.valToPos(i, "x", true);
            const y = (v) => u.valToPos(v, "y", true);
            const color = COLORS[b.figure] || "#495057";
            ctx.strokeStyle = color; ctx.lineWidth = 1.5 * px;
            ctx.beginPath(); ctx.moveTo(cx, y(b.min)); ctx.lineTo(cx, y(b.max));
            ctx.moveTo(cx - half / 2, y(b.min)); ctx.lineTo(cx + half / 2, y(b.min));
            ctx.moveTo(cx - half / 2, y(b.max)); ctx.lineTo(cx + half / 2, y(b.max)); ctx.stroke();
            ctx.fillStyle = color + "33";
            ctx.fillRect(cx - half, y(b.p75), 2 * half, y(b.p25) - y(b.p75));
            ctx.strokeRect(cx - half, y(b.p75), 2 * half, y(b.p25) - y(b.p75));
            ctx.lineWidth = 3 * px; ctx.beginPath(); ctx.moveTo(cx - half, y(b.median)); ctx.lineTo(cx + half, y(b.median)); ctx.stroke();
            ctx.fillStyle = "#1d2433"; ctx.font = (11 * px) + "px system-ui, sans-serif"; ctx.textAlign = "left";
            ctx.fillText(fmt(b.median) + " ms", cx + half + 4 * px, y(b.median) + 4 * px);
          });
          ctx.restore();
        }],
      },
    };
    return new uPlot(opts, [xs, boxes.map((b) => b.median)], el);
  }

  function speedup(el, data) {
    const xs = data.labels.map((_, i) => i);
    const names = Object.keys(data.series);
    const colors = ["#3b5bdb", "#f08c00", "#2b8a3e"];
    const all = names.flatMap((n) => data.series[n]).filter((v) => v != null);
    const top = Math.max(1.2, ...all) * 1.15;
    const opts = {
      width: el.clientWidth, height: 260,
      scales: { x: { time: false, range: [-0.6, xs.length - 0.4] }, y: { range: [0, top] } },
      axes: [
        { splits: () => xs, values: (u, s) => s.map((i) => data.labels[i] || ""), grid: { show: false }, size: 40 },
        { label: "speed-up over eager (×)", values: (u, s) => s.map((v) => v.toFixed(1)), size: 50 },
      ],
      series: [{}].concat(names.map((n, k) => ({
        label: n, fill: colors[k % colors.length] + "cc", stroke: colors[k % colors.length], width: 0,
        paths: uPlot.paths.bars({ size: [0.3, 70], align: k === 0 ? -1 : 1 }), points: { show: false },
        value: (u, v) => (v == null ? "-" : v + "×"),
      }))),
      cursor: { points: { show: false } },
      hooks: {
        draw: [(u) => {  // eager's own speed: 1×
          const ctx = u.ctx, y = u.valToPos(1, "y", true);
          ctx.save(); ctx.strokeStyle = "#c92a2a"; ctx.setLineDash([6, 4]); ctx.lineWidth = uPlot.pxRatio;
          ctx.beginPath(); ctx.moveTo(u.bbox.left, y); ctx.lineTo(u.bbox.left + u.bbox.width, y); ctx.stroke();
          ctx.restore();
        }],
      },
    };
    return new uPlot(opts, [xs].concat(names.map((n) => data.series[n])), el);
  }

  function farm(el, h) {
    const opts = {
      width: el.clientWidth, height: 260,
      scales: { x: { time: true }, jobs: { range: (u, lo, hi) => [0, Math.max(1, hi)] }, rate: { range: (u, lo, hi) => [0, Math.max(1, hi)] } },
      axes: [{}, { scale: "jobs", label: "jobs", size: 48 }, { scale: "rate", label: "ended / min", side: 1, grid: { show: false }, size: 48 }],
      series: [
        {},
        { label: "queued", scale: "jobs", stroke: "#7048e8", width: 2, fill: "#7048e822" },
        { label: "running", scale: "jobs", stroke: "#1c7ed6", width: 2 },
        { label: "succeeded / min", scale: "rate", stroke: "#2b8a3e", width: 1.5, dash: [5, 3] },
        { label: "failed / min", scale: "rate", stroke: "#c92a2a", width: 1.5, dash: [5, 3] },
      ],
    };
    return new uPlot(opts, [h.t, h.queued, h.running, h.succeeded, h.failed], el);
  }

  const KINDS = { latency, speedup, farm };

  function draw() {
    if (typeof uPlot === "undefined") return;
    document.querySelectorAll("[data-plot]").forEach((el) => {
      const kind = KINDS[el.dataset.plot];
      if (!kind || el.dataset.drawn) return;
      el.dataset.drawn = "1";
      kind(el, JSON.parse(el.dataset.series));
    });
  }

  document.addEventListener("DOMContentLoaded", draw);
})();
