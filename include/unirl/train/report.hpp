#pragma once
/// \file report.hpp
/// The run report: one self-contained HTML file (no network, no server: open it from disk) with
/// the curves of each run's metrics files (every numeric key, raw and smoothed, several runs
/// overlaid, one colour per run), `summary.json` and the recipe or options as tables (a column
/// per run), the sampled completions with their rewards (`samples.jsonl`, written by the trainer
/// with `trainer_options::samples_path`) and the images of the run directory (sample grids),
/// embedded as data URIs. The charts are uPlot (MIT), vendored under `train/vendor/uplot/` and
/// embedded in the page. `unirl-report` is this header behind a command line; `unirl-train` and
/// the examples write `<run>/report.html` at the end of a run.
///
/// ```cpp
/// unirl::train::write_report("runs/exp1");                                    // runs/exp1/report.html
/// unirl::train::write_report({"runs/exp1", "runs/exp2"}, "compare.html");     // two runs overlaid
/// ```
///
/// What a run directory may hold (all optional; a directory with none of them is an error):
/// - `*metrics*.jsonl` (top level and one directory down, e.g. `rl/metrics.jsonl`): one JSON object
///   per row; the x axis is `step` when a row has it, else the row's index; every key with a
///   number in some row is a curve (null, a string or a missing key is a gap);
/// - `summary.json`: its top-level values as a table; its `recipe` or `options` object (or a
///   `recipe.json` beside it) as a second table of dotted keys;
/// - `samples.jsonl`: rows `{"step", "prompt", "completion", "reference", "reward"}` (the last
///   `max_samples` are shown);
/// - `*.png` (top level): shown as images, unless named `*curve*.png` (the charts replace those).
///
/// Every file is untrusted input: the data travels as JSON in a `<script type="application/json">`
/// element with `<`, `>` and `&` escaped (a `</script>` inside a string cannot end it), invalid
/// UTF-8 is replaced, and the page inserts text with `textContent` only. A malformed line of a
/// JSON-lines file is an error naming the file and line, except a last line with no newline (a
/// run killed while writing it), which is skipped and noted in the page.
///
/// The page checks itself: after loading it writes what it rendered (charts, points per series,
/// errors caught from `window.onerror` and `console.error`) as JSON into `#unirl-selftest`, which
/// the browser test reads from Chromium's `--dump-dom`.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <boost/beast/core/detail/base64.hpp>
#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/train/vendor/uplot/uplot.hpp>

namespace unirl::train {

/// Settings of a report.
struct report_options {
  std::string title{};                      // the page's title; empty: "unirl report: <run names>"
  std::int64_t max_samples = 200;           // sampled completions shown per run (the latest ones)
  std::int64_t max_image_bytes = 4 << 20;   // a larger PNG is listed by name, not embedded
  std::int64_t max_images = 16;             // PNGs embedded per run
};

namespace detail {

inline std::string read_file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw error("report: cannot open '" + p.string() + "'");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline nlohmann::json parse_json_file(const std::filesystem::path& p) {
  const auto text = read_file_bytes(p);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw error("report: '" + p.string() + "' is not JSON: " + e.what());
  }
}

// The rows of a JSON-lines file. A last line with no newline that does not parse (a write cut
// short) is skipped and described in `note`; any other malformed line throws naming the line.
inline std::vector<nlohmann::json> read_jsonl_rows(const std::filesystem::path& p, std::string& note) {
  const auto text = read_file_bytes(p);
  std::vector<nlohmann::json> rows;
  std::size_t begin = 0, line = 0;
  while (begin < text.size()) {
    const auto nl = text.find('\n', begin);
    const bool last_unterminated = nl == std::string::npos;
    const auto end = last_unterminated ? text.size() : nl;
    ++line;
    const std::string_view s(text.data() + begin, end - begin);
    begin = last_unterminated ? text.size() : nl + 1;
    if (s.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    try {
      auto row = nlohmann::json::parse(s);
      if (!row.is_object()) throw error("report: '" + p.string() + "' line " + std::to_string(line) +
                                        " is not a JSON object (" + std::string(row.type_name()) + ")");
      rows.push_back(std::move(row));
    } catch (const nlohmann::json::exception& e) {
      if (last_unterminated) {
        note = "line " + std::to_string(line) + " of " + p.filename().string() +
               " is incomplete (no newline, not JSON) and was skipped";
        break;
      }
      throw error("report: '" + p.string() + "' line " + std::to_string(line) + " is not JSON: " + e.what());
    }
  }
  return rows;
}

inline bool is_number(const nlohmann::json& v) { return v.is_number() && std::isfinite(v.get<double>()); }

// A metrics file as columns: {"file", "x" (the x name), "rows", "keys": [...], "columns": {key: [...]}}
// with x first among the columns; a value that is not a finite number is null.
inline nlohmann::json metric_columns(const std::vector<nlohmann::json>& rows, const std::string& file) {
  const bool has_step = !rows.empty() && std::all_of(rows.begin(), rows.end(), [](const auto& r) {
    return r.contains("step") && is_number(r.at("step"));
  });
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const auto& r : rows)
    for (const auto& [k, v] : r.items())
      if (is_number(v) && !(has_step && k == "step") && seen.insert(k).second) keys.push_back(k);
  nlohmann::json x = nlohmann::json::array();
  for (std::size_t i = 0; i < rows.size(); ++i)
    x.push_back(has_step ? rows[i].at("step").get<double>() : static_cast<double>(i));
  nlohmann::json columns = nlohmann::json::object();
  for (const auto& k : keys) {
    nlohmann::json col = nlohmann::json::array();
    for (const auto& r : rows) {
      const auto it = r.find(k);
      col.push_back(it != r.end() && is_number(*it) ? nlohmann::json(it->get<double>()) : nlohmann::json(nullptr));
    }
    columns[k] = std::move(col);
  }
  return {{"file", file}, {"x", has_step ? "step" : "row"}, {"rows", rows.size()}, {"keys", keys},
          {"xs", std::move(x)}, {"columns", std::move(columns)}};
}

inline bool is_metrics_file(const std::filesystem::path& p) {
  const auto name = p.filename().string();
  return p.extension() == ".jsonl" && name.find("metrics") != std::string::npos;
}

inline std::vector<std::filesystem::path> sorted_entries(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) out.push_back(it->path());
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string base64(const std::string& bytes) {
  namespace b64 = boost::beast::detail::base64;
  std::string out(b64::encoded_size(bytes.size()), '\0');
  out.resize(b64::encode(out.data(), bytes.data(), bytes.size()));
  return out;
}

// The JSON text put inside a <script> element: '<', '>' and '&' as \u escapes (valid JSON: they
// can only occur inside strings), so no string can close the element or open a comment.
inline std::string script_safe_json(const nlohmann::json& j) {
  const auto s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(s.size() + s.size() / 16);
  for (const char c : s) {
    if (c == '<') out += "\\u003c";
    else if (c == '>') out += "\\u003e";
    else if (c == '&') out += "\\u0026";
    else out += c;
  }
  return out;
}

// Escapes text for an HTML element's content or attribute.
inline std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace detail

/// What the report shows of one run directory, as JSON: `name` (the directory's name), `dir`,
/// `metrics` (one entry of columns per metrics file), `summary`, `recipe`, `samples`, `images`
/// (`{name, data}` with a data URI) and `notes`. Throws `unirl::error` when `dir` is not a
/// directory or holds nothing a report shows.
inline nlohmann::json read_run(const std::filesystem::path& dir, const report_options& o = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  UNIRL_CHECK(fs::is_directory(dir, ec), "report: '", dir.string(), "' is not a directory (expected a run directory)");
  auto name = fs::weakly_canonical(dir, ec).filename().string();
  if (name.empty()) name = dir.string();
  nlohmann::json run{{"name", name}, {"dir", dir.string()}, {"metrics", nlohmann::json::array()},
                     {"summary", nullptr}, {"recipe", nullptr}, {"samples", nlohmann::json::array()},
                     {"images", nlohmann::json::array()}, {"notes", nlohmann::json::array()}};
  // Metrics files: top level first, then one directory down (not checkpoints/ or export/).
  std::vector<std::pair<fs::path, std::string>> metric_files;
  for (const auto& p : detail::sorted_entries(dir)) {
    if (fs::is_regular_file(p, ec) && detail::is_metrics_file(p)) metric_files.emplace_back(p, p.filename().string());
  }
  for (const auto& sub : detail::sorted_entries(dir)) {
    const auto sname = sub.filename().string();
    if (!fs::is_directory(sub, ec) || sname == "checkpoints" || sname == "export") continue;
    for (const auto& p : detail::sorted_entries(sub))
      if (fs::is_regular_file(p, ec) && detail::is_metrics_file(p))
        metric_files.emplace_back(p, sname + "/" + p.filename().string());
  }
  for (const auto& [p, label] : metric_files) {
    std::string note;
    const auto rows = detail::read_jsonl_rows(p, note);
    if (!note.empty()) run["notes"].push_back(note);
    run["metrics"].push_back(detail::metric_columns(rows, label));
  }
  bool found = !metric_files.empty();
  if (fs::is_regular_file(dir / "summary.json", ec)) {
    auto summary = detail::parse_json_file(dir / "summary.json");
    if (summary.is_object()) {
      for (const char* k : {"recipe", "options"}) {
        if (summary.contains(k) && summary[k].is_object()) {
          run["recipe"] = summary[k];
          summary.erase(k);
          break;
        }
      }
    }
    run["summary"] = std::move(summary);
    found = true;
  }
  if (fs::is_regular_file(dir / "recipe.json", ec)) {
    run["recipe"] = detail::parse_json_file(dir / "recipe.json");
    found = true;
  }
  if (fs::is_regular_file(dir / "samples.jsonl", ec)) {
    std::string note;
    auto rows = detail::read_jsonl_rows(dir / "samples.jsonl", note);
    if (!note.empty()) run["notes"].push_back(note);
    const auto keep = static_cast<std::size_t>(std::max<std::int64_t>(0, o.max_samples));
    if (rows.size() > keep) {
      run["notes"].push_back("samples.jsonl: the last " + std::to_string(keep) + " of " + std::to_string(rows.size()) +
                             " samples are shown");
      rows.erase(rows.begin(), rows.end() - static_cast<std::ptrdiff_t>(keep));
    }
    run["samples"] = std::move(rows);
    found = true;
  }
  std::int64_t images = 0;
  for (const auto& p : detail::sorted_entries(dir)) {
    const auto fname = p.filename().string();
    if (p.extension() != ".png" || fname.find("curve") != std::string::npos || !fs::is_regular_file(p, ec)) continue;
    found = true;
    const auto size = fs::file_size(p, ec);
    if (ec || static_cast<std::int64_t>(size) > o.max_image_bytes || images >= o.max_images) {
      run["notes"].push_back(fname + " is not embedded (" + (images >= o.max_images ? "too many images" : "too large") + ")");
      continue;
    }
    const auto bytes = detail::read_file_bytes(p);
    static constexpr unsigned char png_magic[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (bytes.size() < sizeof png_magic || !std::equal(std::begin(png_magic), std::end(png_magic), bytes.begin(),
                                                       [](unsigned char a, char b) { return a == static_cast<unsigned char>(b); })) {
      run["notes"].push_back(fname + " is not a PNG file and is not shown");
      continue;
    }
    run["images"].push_back({{"name", fname}, {"data", "data:image/png;base64," + detail::base64(bytes)}});
    ++images;
  }
  UNIRL_CHECK(found, "report: '", dir.string(),
              "' holds no metrics (*metrics*.jsonl), summary.json, recipe.json, samples.jsonl or PNG image: "
              "expected a run directory");
  return run;
}

namespace detail {

// The page's own style and script (the data and uPlot come in their own elements).
inline constexpr const char* report_css = R"unirl_css(
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2937;color:#fff;padding:12px 20px}
header h1{font-size:18px;margin:0 0 6px}
.runs span{display:inline-block;margin-right:16px;font-size:13px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}
main{padding:8px 20px 40px}
h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:14px;margin:14px 0 6px}
.controls{display:flex;flex-wrap:wrap;gap:16px;align-items:center;margin:8px 0;font-size:13px}
.grid{display:flex;flex-wrap:wrap;gap:10px}
.chart{background:#fff;border:1px solid #e3e3e3;border-radius:4px;padding:4px}
.chart .title{font-weight:600;font-size:12px;margin:2px 4px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;max-width:380px}
table{border-collapse:collapse;background:#fff;font-size:12px;margin-bottom:8px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.diff td{background:#fff7d6}
td.text{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;max-width:520px;word-break:break-word}
.notes{color:#8a4b00;font-size:12px}
.images{display:flex;flex-wrap:wrap;gap:14px}
.images figure{margin:0;background:#fff;border:1px solid #e3e3e3;padding:6px}
.images img{image-rendering:pixelated;max-width:420px}
.images figcaption{font-size:12px;color:#555}
.muted{color:#777;font-size:12px}
#unirl-selftest{display:none}
)unirl_css";

// Records errors before anything else runs, and writes the self-test summary after load.
inline constexpr const char* report_guard_js = R"unirl_js(
window.unirlErrors = [];
window.addEventListener('error', function (e) { window.unirlErrors.push(String(e.message || e)); });
window.addEventListener('unhandledrejection', function (e) { window.unirlErrors.push('unhandled rejection: ' + String(e.reason)); });
(function () {
  var original = console.error;
  console.error = function () {
    window.unirlErrors.push(Array.prototype.map.call(arguments, String).join(' '));
    return original.apply(console, arguments);
  };
})();
window.unirlRendered = { charts: 0, series: [] };
window.addEventListener('load', function () {
  var out = document.getElementById('unirl-selftest');
  out.textContent = JSON.stringify({ charts: window.unirlRendered.charts, series: window.unirlRendered.series,
                                     errors: window.unirlErrors, done: true });
});
)unirl_js";

inline constexpr const char* report_js = R"unirl_js(
(function () {
  'use strict';
  var data = JSON.parse(document.getElementById('unirl-data').textContent);
  var palette = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
  var runs = data.runs;
  function colour(i) { return palette[i % palette.length]; }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return '';
    if (typeof v === 'number') {
      if (Number.isInteger(v)) return String(v);
      if (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3) return v.toExponential(4).replace(/\.?0+e/, 'e');
      return String(Number(v.toPrecision(6)));
    }
    if (typeof v === 'object') return JSON.stringify(v);
    return String(v);
  }

  // Header: one colour per run.
  var legend = document.getElementById('runs');
  runs.forEach(function (r, i) {
    var s = el('span');
    var sw = el('span', 'swatch'); sw.style.background = colour(i);
    s.appendChild(sw); s.appendChild(document.createTextNode(r.name));
    s.title = r.dir;
    legend.appendChild(s);
  });

  // ---- Curves.
  var files = [];
  runs.forEach(function (r) { r.metrics.forEach(function (m) { if (files.indexOf(m.file) < 0) files.push(m.file); }); });
  var fileSel = document.getElementById('file'), filter = document.getElementById('filter');
  var smoothIn = document.getElementById('smooth'), smoothOut = document.getElementById('smooth-value');
  var showRaw = document.getElementById('raw'), showSmooth = document.getElementById('smoothed');
  files.forEach(function (f) { var o = el('option', null, f); o.value = f; fileSel.appendChild(o); });
  if (!files.length) document.getElementById('curves').appendChild(el('p', 'muted', 'No metrics file in these runs.'));

  // Exponential moving average with debiasing (as TensorBoard's smoothing); gaps stay gaps.
  function smooth(ys, w) {
    var out = new Array(ys.length), last = 0, n = 0;
    for (var i = 0; i < ys.length; i++) {
      var y = ys[i];
      if (y === null) { out[i] = null; continue; }
      last = last * w + (1 - w) * y; n++;
      out[i] = w > 0 ? last / (1 - Math.pow(w, n)) : y;
    }
    return out;
  }
  // A constant series gets a small range around its value (uPlot's default for 0 is 0..100).
  function yRange(u, min, max) {
    if (min === null || max === null) return [0, 1];
    if (min === max) { var d = Math.abs(min) * 0.1 || 1; return [min - d, max + d]; }
    return uPlot.rangeNum(min, max, 0.1, true);
  }
  function tick(v) {
    if (v === null || v === undefined) return '';
    if (v !== 0 && Math.abs(v) < 1e-3) return v.toExponential(1).replace('.0e', 'e');
    if (Math.abs(v) >= 1e5) return v.toExponential(1).replace('.0e', 'e');
    return String(Number(v.toPrecision(4)));
  }
  var charts = [];
  function draw() {
    charts.forEach(function (c) { c.destroy(); });
    charts = [];
    window.unirlRendered = { charts: 0, series: [] };
    var grid = document.getElementById('grid');
    grid.textContent = '';
    var file = fileSel.value, w = Number(smoothIn.value);
    smoothOut.textContent = w.toFixed(2);
    var keys = [];
    runs.forEach(function (r) {
      r.metrics.forEach(function (m) {
        if (m.file !== file) return;
        m.keys.forEach(function (k) { if (keys.indexOf(k) < 0) keys.push(k); });
      });
    });
    // The filter: words (space, comma or | between them); a key is shown when it contains one.
    var terms = filter.value.toLowerCase().split(/[\s,|]+/).filter(Boolean);
    keys = keys.filter(function (k) {
      return !terms.length || terms.some(function (t) { return k.toLowerCase().indexOf(t) >= 0; });
    });
    // The rewards first, then the losses and KL, then the rest in their order.
    function rank(k) { return k === 'reward_mean' ? 0 : /^reward/.test(k) ? 1 : /^(loss|kl|entropy|accuracy)/.test(k) ? 2 : 3; }
    keys = keys.map(function (k, i) { return [rank(k), i, k]; })
               .sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; }).map(function (e) { return e[2]; });
    // As many columns of at least 300 px as fit (a chart's box adds 10 px, the gap 10 px).
    var avail = grid.clientWidth || 1240, ncol = Math.max(1, Math.floor((avail + 10) / 320));
    var width = Math.floor((avail - 10 * (ncol - 1)) / ncol) - 10;
    keys.forEach(function (key) {
      var tables = [], series = [{ label: 'step' }], counts = [];
      runs.forEach(function (r, i) {
        var m = r.metrics.filter(function (m) { return m.file === file; })[0];
        if (!m || !m.columns[key]) return;
        var ys = m.columns[key], xs = m.xs;
        // uPlot wants increasing x: order by x, keeping the last row of a repeated step.
        var idx = xs.map(function (_, j) { return j; }).sort(function (a, b) { return xs[a] - xs[b] || a - b; });
        var ux = [], uy = [];
        idx.forEach(function (j) {
          if (ux.length && ux[ux.length - 1] === xs[j]) { uy[uy.length - 1] = ys[j]; return; }
          ux.push(xs[j]); uy.push(ys[j]);
        });
        var points = uy.filter(function (v) { return v !== null; }).length;
        var cols = [ux];
        if (showRaw.checked) {
          cols.push(uy);
          series.push({ label: r.name + ' (raw)', stroke: colour(i), width: 1, alpha: showSmooth.checked ? 0.3 : 1, spanGaps: true,
                        points: { show: points < 60 && !showSmooth.checked } });
          counts.push({ run: r.name, kind: 'raw', points: points });
        }
        if (showSmooth.checked) {
          cols.push(smooth(uy, w));
          series.push({ label: r.name, stroke: colour(i), width: 2, spanGaps: true, points: { show: false } });
          counts.push({ run: r.name, kind: 'smoothed', points: points });
        }
        tables.push(cols);
      });
      if (!tables.length || series.length < 2) return;
      var aligned = tables.length === 1 ? tables[0] : uPlot.join(tables);
      var box = el('div', 'chart');
      box.appendChild(el('div', 'title', key)).title = key;
      grid.appendChild(box);
      var u = new uPlot({ width: width, height: 200, series: series, legend: { show: false },
                          scales: { x: { time: false }, y: { range: yRange } },
                          axes: [{ size: 30 }, { size: 56, values: function (u, ticks) { return ticks.map(tick); } }],
                          cursor: { sync: { key: 'unirl' } } },
                        aligned, box);
      charts.push(u);
      window.unirlRendered.charts++;
      // What was drawn: the non-null points of each series as uPlot holds them.
      counts.forEach(function (c, j) {
        var ys = u.data[j + 1], n = 0;
        for (var t = 0; t < ys.length; t++) if (ys[t] !== null && ys[t] !== undefined) n++;
        window.unirlRendered.series.push({ chart: key, file: file, run: c.run, kind: c.kind, points: n, expected: c.points });
      });
    });
    if (!keys.length && files.length) grid.appendChild(el('p', 'muted', 'No key matches the filter.'));
  }
  // report.html#filter=reward,loss opens with that filter.
  var fromHash = /[#&]filter=([^&]*)/.exec(location.hash);
  if (fromHash) filter.value = decodeURIComponent(fromHash[1]);
  [fileSel, showRaw, showSmooth].forEach(function (e) { e.addEventListener('change', draw); });
  smoothIn.addEventListener('input', draw);
  filter.addEventListener('input', draw);
  if (files.length) draw();
  document.getElementById('rows').textContent = runs.map(function (r) {
    return r.name + ': ' + r.metrics.map(function (m) { return m.file + ' ' + m.rows + ' rows'; }).join(', ');
  }).join(' | ');

  // ---- Tables with a column per run; rows whose values differ between runs are marked.
  function flatten(obj, prefix, out) {
    if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) { out[prefix] = obj; return out; }
    var ks = Object.keys(obj);
    if (!ks.length && prefix) out[prefix] = {};
    ks.forEach(function (k) { flatten(obj[k], prefix ? prefix + '.' + k : k, out); });
    return out;
  }
  function table(where, field, empty) {
    var flat = runs.map(function (r) { return r[field] ? flatten(r[field], '', {}) : null; });
    if (flat.every(function (f) { return f === null; })) { where.appendChild(el('p', 'muted', empty)); return; }
    var keys = [];
    flat.forEach(function (f) { if (f) Object.keys(f).forEach(function (k) { if (keys.indexOf(k) < 0) keys.push(k); }); });
    var t = el('table'), head = el('tr');
    head.appendChild(el('th', null, 'key'));
    runs.forEach(function (r, i) { var th = el('th', null, r.name); th.style.borderTop = '3px solid ' + colour(i); head.appendChild(th); });
    t.appendChild(head);
    keys.forEach(function (k) {
      var tr = el('tr'), vals = flat.map(function (f) { return f ? fmt(f[k]) : ''; });
      if (runs.length > 1 && vals.some(function (v) { return v !== vals[0]; })) tr.className = 'diff';
      tr.appendChild(el('td', null, k));
      flat.forEach(function (f, i) { tr.appendChild(el('td', f && typeof f[k] === 'number' ? 'num' : null, vals[i])); });
      t.appendChild(tr);
    });
    where.appendChild(t);
  }
  table(document.getElementById('summary'), 'summary', 'No summary.json in these runs.');
  table(document.getElementById('recipe'), 'recipe', 'No recipe or options in these runs.');

  // ---- Sampled completions.
  var samples = document.getElementById('samples'), anySamples = false;
  runs.forEach(function (r, i) {
    if (!r.samples.length) return;
    anySamples = true;
    var h = el('h3', null, r.name + ' (' + r.samples.length + ' samples)'); h.style.color = colour(i);
    samples.appendChild(h);
    var t = el('table'), head = el('tr');
    ['step', 'reward', 'prompt', 'completion', 'reference'].forEach(function (c) { head.appendChild(el('th', null, c)); });
    t.appendChild(head);
    r.samples.slice().reverse().forEach(function (s) {
      var tr = el('tr');
      tr.appendChild(el('td', 'num', fmt(s.step)));
      tr.appendChild(el('td', 'num', fmt(s.reward)));
      ['prompt', 'completion', 'reference'].forEach(function (c) { tr.appendChild(el('td', 'text', s[c] === undefined ? '' : fmt(s[c]))); });
      t.appendChild(tr);
    });
    samples.appendChild(t);
  });
  if (!anySamples) samples.appendChild(el('p', 'muted', 'No samples.jsonl in these runs (text runs write one).'));

  // ---- Images (sample grids).
  var images = document.getElementById('images'), anyImages = false;
  runs.forEach(function (r, i) {
    if (!r.images.length) return;
    anyImages = true;
    var h = el('h3', null, r.name); h.style.color = colour(i);
    images.appendChild(h);
    var box = el('div', 'images');
    r.images.forEach(function (im) {
      var f = el('figure'), img = el('img');
      img.src = im.data; img.alt = im.name;
      f.appendChild(img); f.appendChild(el('figcaption', null, im.name));
      box.appendChild(f);
    });
    images.appendChild(box);
  });
  if (!anyImages) images.appendChild(el('p', 'muted', 'No images in these runs.'));

  // ---- Notes (skipped lines, images left out).
  var notes = document.getElementById('notes');
  runs.forEach(function (r) { r.notes.forEach(function (n) { notes.appendChild(el('div', null, r.name + ': ' + n)); }); });
})();
)unirl_js";

}  // namespace detail

/// The report of `runs` (run directories, each read with `read_run`) as one HTML page.
inline std::string render_report(const std::vector<std::filesystem::path>& runs, const report_options& o = {}) {
  UNIRL_CHECK(!runs.empty(), "report: no run directory given");
  nlohmann::json data{{"runs", nlohmann::json::array()}};
  std::string names;
  for (const auto& r : runs) {
    data["runs"].push_back(read_run(r, o));
    names += (names.empty() ? "" : ", ") + data["runs"].back()["name"].get<std::string>();
  }
  const auto title = o.title.empty() ? "unirl report: " + names : o.title;
  char when[64] = "";
  const std::time_t now = std::time(nullptr);
  if (const std::tm* t = std::gmtime(&now)) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", t);
  // The vendored and own scripts hold no "</script": checked, since the page would break there.
  for (const char* js : {vendor::uplot_js, detail::report_js, detail::report_guard_js}) {
    std::string s(js);
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    UNIRL_CHECK(s.find("</script") == std::string::npos, "report: an embedded script contains </script");
  }
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
    << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
    << "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
       "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n"
    << "<title>" << detail::html_escape(title) << "</title>\n"
    << "<script>" << detail::report_guard_js << "</script>\n"
    << "<style>" << vendor::uplot_css << "</style>\n<style>" << detail::report_css << "</style>\n</head>\n<body>\n"
    << "<header><h1>" << detail::html_escape(title) << "</h1><div class=\"runs\" id=\"runs\"></div></header>\n<main>\n"
    << "<h2>Curves</h2>\n<div class=\"controls\" id=\"curves\">"
    << "<label>file <select id=\"file\"></select></label>"
    << "<label>smoothing <input id=\"smooth\" type=\"range\" min=\"0\" max=\"0.99\" step=\"0.01\" value=\"0.6\"> "
       "<span id=\"smooth-value\"></span></label>"
    << "<label><input id=\"smoothed\" type=\"checkbox\" checked> smoothed</label>"
    << "<label><input id=\"raw\" type=\"checkbox\" checked> raw</label>"
    << "<label>keys <input id=\"filter\" type=\"search\" placeholder=\"filter, e.g. reward loss\"></label>"
    << "<span class=\"muted\" id=\"rows\"></span></div>\n"
    << "<p class=\"muted\">One colour per run; faint: the raw values, solid: smoothed (exponential moving "
       "average, debiased). Drag to zoom, double-click to reset.</p>\n"
    << "<div class=\"grid\" id=\"grid\"></div>\n"
    << "<div class=\"notes\" id=\"notes\"></div>\n"
    << "<h2>Summary</h2><div id=\"summary\"></div>\n"
    << "<h2>Sampled completions</h2><div id=\"samples\"></div>\n"
    << "<h2>Images</h2><div id=\"images\"></div>\n"
    << "<h2>Recipe / options</h2><div id=\"recipe\"></div>\n"
    << "<p class=\"muted\">Written " << when << " by unirl (charts: uPlot " << vendor::uplot_version
    << ", MIT licence).</p>\n</main>\n"
    << "<pre id=\"unirl-selftest\"></pre>\n"
    << "<script type=\"application/json\" id=\"unirl-data\">" << detail::script_safe_json(data) << "</script>\n"
    << "<script>" << vendor::uplot_js << "</script>\n"
    << "<script>" << detail::report_js << "</script>\n"
    << "</body></html>\n";
  return h.str();
}

/// Writes the report of `runs` to `out` (its directory created); returns `out`.
inline std::filesystem::path write_report(const std::vector<std::filesystem::path>& runs, const std::filesystem::path& out,
                                          const report_options& o = {}) {
  const auto html = render_report(runs, o);
  std::error_code ec;
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path(), ec);
  const auto tmp = out.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    UNIRL_CHECK(static_cast<bool>(f), "report: cannot open '", tmp, "' for writing");
    f << html;
    f.close();
    UNIRL_CHECK(static_cast<bool>(f), "report: writing '", tmp, "' failed");
  }
  std::filesystem::rename(tmp, out, ec);
  UNIRL_CHECK(!ec, "report: cannot rename '", tmp, "' to '", out.string(), "': ", ec.message());
  return out;
}

/// Writes `<run>/report.html` for one run directory; returns its path.
inline std::filesystem::path write_report(const std::filesystem::path& run, const report_options& o = {}) {
  return write_report(std::vector<std::filesystem::path>{run}, run / "report.html", o);
}

}  // namespace unirl::train
