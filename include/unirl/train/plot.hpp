#pragma once
/// \file plot.hpp
/// Line plots written as PNG files, with no plotting library: curves are rasterised here, text
/// is drawn with stb_easy_font and the file is written with stb_image_write. Needs unirl built
/// with stb (`UNIRL_WITH_STB`); without it the functions throw `unirl::error` saying so.
///
/// ```cpp
/// unirl::train::plot_series("reward.png", {{"reward", steps, rewards}}, "mean reward");
/// unirl::train::plot_metrics("runs/exp1/metrics.jsonl", "runs/exp1/curves.png",
///                            {"reward_mean", "kl", "grad_norm"});
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/detail/stb.hpp>
#include <unirl/train/metrics.hpp>

namespace unirl::train {

/// One curve: `y[i]` against `x[i]`. Non-finite values break the line.
struct series {
  std::string name;
  std::vector<double> x, y;
};

/// The colours curves take, in order (Tableau 10).
inline constexpr std::array<std::array<std::uint8_t, 3>, 10> plot_palette{{{31, 119, 180},
                                                                           {255, 127, 14},
                                                                           {44, 160, 44},
                                                                           {214, 39, 40},
                                                                           {148, 103, 189},
                                                                           {140, 86, 75},
                                                                           {227, 119, 194},
                                                                           {127, 127, 127},
                                                                           {188, 189, 34},
                                                                           {23, 190, 207}}};

namespace detail {

/// An RGB raster, row-major, 3 bytes per pixel.
struct rgb_image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> pixels{};
  rgb_image(int w, int h) : width(w), height(h), pixels(static_cast<std::size_t>(w) * h * 3, 255) {}

  void set(int x, int y, const std::array<std::uint8_t, 3>& c) {
    if (x < 0 || y < 0 || x >= width || y >= height) return;
    auto* p = &pixels[(static_cast<std::size_t>(y) * width + x) * 3];
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }
  void fill(int x0, int y0, int x1, int y1, const std::array<std::uint8_t, 3>& c) {  // [x0,x1) x [y0,y1)
    for (int y = std::max(0, y0); y < std::min(height, y1); ++y)
      for (int x = std::max(0, x0); x < std::min(width, x1); ++x) set(x, y, c);
  }
  // Bresenham, two pixels thick.
  void line(int x0, int y0, int x1, int y1, const std::array<std::uint8_t, 3>& c) {
    const int dx = std::abs(x1 - x0), sx = x0 < x1 ? 1 : -1;
    const int dy = -std::abs(y1 - y0), sy = y0 < y1 ? 1 : -1;
    const bool steep = -dy > dx;
    int err = dx + dy;
    for (;;) {
      set(x0, y0, c);
      if (steep) set(x0 + 1, y0, c); else set(x0, y0 + 1, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) { err += dy; x0 += sx; }
      if (e2 <= dx) { err += dx; y0 += sy; }
    }
  }
};

#if UNIRL_HAS_STB
inline std::vector<char> printable(const std::string& s) {
  std::vector<char> t;
  for (char ch : s) t.push_back(ch >= 32 && ch < 127 ? ch : '?');
  t.push_back('\0');
  return t;
}
inline int text_width(const std::string& s) {
  auto t = printable(s);
  return stb_easy_font_width(t.data());
}
/// Draws `s` with its top-left corner at (x, y), each font unit `scale` pixels.
inline void draw_text(rgb_image& img, int x, int y, const std::string& s, const std::array<std::uint8_t, 3>& c,
                      int scale = 1) {
  auto t = printable(s);
  std::vector<char> buf(t.size() * 300 + 64);
  unsigned char colour[4] = {c[0], c[1], c[2], 255};
  const int quads = stb_easy_font_print(0.f, 0.f, t.data(), colour, buf.data(), static_cast<int>(buf.size()));
  const auto* v = reinterpret_cast<const float*>(buf.data());  // 4 floats per vertex: x, y, z, rgba
  for (int q = 0; q < quads; ++q) {
    const float* quad = v + q * 16;
    float xmin = quad[0], xmax = quad[0], ymin = quad[1], ymax = quad[1];
    for (int k = 1; k < 4; ++k) {
      xmin = std::min(xmin, quad[k * 4]), xmax = std::max(xmax, quad[k * 4]);
      ymin = std::min(ymin, quad[k * 4 + 1]), ymax = std::max(ymax, quad[k * 4 + 1]);
    }
    img.fill(x + static_cast<int>(std::lround(xmin * scale)), y + static_cast<int>(std::lround(ymin * scale)),
             x + static_cast<int>(std::lround(xmax * scale)), y + static_cast<int>(std::lround(ymax * scale)), c);
  }
}
#endif

inline std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

/// The pixel rectangle of a panel's plotting area, and the data range it shows.
struct plot_frame {
  int x = 0, y = 0, w = 0, h = 0;
  double xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  int px(double v) const { return x + static_cast<int>(std::lround((v - xmin) / (xmax - xmin) * (w - 1))); }
  int py(double v) const { return y + static_cast<int>(std::lround((1.0 - (v - ymin) / (ymax - ymin)) * (h - 1))); }
};

/// Where the curves of a panel at (x0, y0, width, height) go, and their range.
inline plot_frame frame_for(const std::vector<series>& s, int x0, int y0, int width, int height) {
  plot_frame f;
  f.x = x0 + 64, f.y = y0 + 26, f.w = width - 64 - 14, f.h = height - 26 - 20;
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (const auto& c : s)
    for (std::size_t i = 0; i < c.x.size(); ++i)
      if (std::isfinite(c.x[i]) && std::isfinite(c.y[i])) {
        xlo = std::min(xlo, c.x[i]), xhi = std::max(xhi, c.x[i]);
        ylo = std::min(ylo, c.y[i]), yhi = std::max(yhi, c.y[i]);
      }
  if (!(xlo <= xhi)) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  if (xlo == xhi) xlo -= 0.5, xhi += 0.5;
  if (ylo == yhi) {
    const double pad = ylo != 0.0 ? std::abs(ylo) * 0.1 : 0.5;
    ylo -= pad, yhi += pad;
  }
  f.xmin = xlo, f.xmax = xhi, f.ymin = ylo, f.ymax = yhi;
  return f;
}

#if UNIRL_HAS_STB
/// Draws one panel: frame, grid, min/max labels, title, legend and curves.
inline void draw_panel(rgb_image& img, const std::vector<series>& s, const std::string& title, int x0, int y0,
                       int width, int height) {
  const std::array<std::uint8_t, 3> black{0, 0, 0}, grid{225, 225, 225}, axis{120, 120, 120};
  const plot_frame f = frame_for(s, x0, y0, width, height);
  for (int k = 1; k < 4; ++k) {
    const int gy = f.y + k * (f.h - 1) / 4;
    img.fill(f.x, gy, f.x + f.w, gy + 1, grid);
  }
  img.fill(f.x - 1, f.y - 1, f.x + f.w + 1, f.y, axis);
  img.fill(f.x - 1, f.y + f.h, f.x + f.w + 1, f.y + f.h + 1, axis);
  img.fill(f.x - 1, f.y - 1, f.x, f.y + f.h + 1, axis);
  img.fill(f.x + f.w, f.y - 1, f.x + f.w + 1, f.y + f.h + 1, axis);

  draw_text(img, x0 + 8, y0 + 5, title, black, 2);
  const auto ymax = number_text(f.ymax), ymin = number_text(f.ymin);
  draw_text(img, f.x - 6 - text_width(ymax), f.y - 3, ymax, black);
  draw_text(img, f.x - 6 - text_width(ymin), f.y + f.h - 6, ymin, black);
  const auto xmin = number_text(f.xmin), xmax = number_text(f.xmax);
  draw_text(img, f.x, f.y + f.h + 5, xmin, black);
  draw_text(img, f.x + f.w - text_width(xmax), f.y + f.h + 5, xmax, black);

  // Legend, right-aligned in the title band (a single curve is named by the title).
  int lx = x0 + width - 14;
  for (std::size_t i = s.size(); s.size() > 1 && i-- > 0;) {
    const auto& c = plot_palette[i % plot_palette.size()];
    lx -= text_width(s[i].name);
    draw_text(img, lx, y0 + 9, s[i].name, black);
    lx -= 14;
    img.fill(lx, y0 + 9, lx + 10, y0 + 16, c);
    lx -= 12;
  }

  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto& c = plot_palette[i % plot_palette.size()];
    const auto& cs = s[i];
    bool have = false;
    int lx0 = 0, ly0 = 0;
    for (std::size_t k = 0; k < cs.x.size(); ++k) {
      if (!std::isfinite(cs.x[k]) || !std::isfinite(cs.y[k])) { have = false; continue; }
      const int px = f.px(cs.x[k]), py = f.py(cs.y[k]);
      if (have) img.line(lx0, ly0, px, py, c);
      else img.fill(px - 1, py - 1, px + 2, py + 2, c);
      lx0 = px, ly0 = py, have = true;
    }
  }
}
#endif

inline void write_png(const std::string& path, const rgb_image& img) {
#if UNIRL_HAS_STB
  const std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (stbi_write_png(path.c_str(), img.width, img.height, 3, img.pixels.data(), img.width * 3) == 0)
    throw error("plot: cannot write the PNG file '" + path + "'");
#else
  (void)img;
  throw error("plot: cannot write '" + path + "': unirl was built without stb (stb_image_write.h not found; "
              "install libstb-dev and reconfigure)");
#endif
}

inline void require_stb(const char* who) {
#if !UNIRL_HAS_STB
  throw error(std::string(who) + ": unirl was built without stb (stb_image_write.h not found; "
                                 "install libstb-dev and reconfigure)");
#else
  (void)who;
#endif
}

inline void check_series(const std::vector<series>& s, const char* who) {
  UNIRL_CHECK(!s.empty(), who, ": no series given; expected at least one");
  for (const auto& c : s)
    UNIRL_CHECK(c.x.size() == c.y.size(), who, ": series '", c.name, "' has ", c.x.size(), " x values but ",
                c.y.size(), " y values; expected as many of each");
}

}  // namespace detail

/// Writes a PNG of `s` as lines in one panel, with `title`, a legend and the axes' min / max.
/// Throws `unirl::error` for mismatched x / y lengths, a size under 160 x 100, or an
/// unwritable file.
inline void plot_series(const std::string& png_path, const std::vector<series>& s, const std::string& title,
                        int width = 640, int height = 360) {
  detail::require_stb("plot_series");
  detail::check_series(s, "plot_series");
  UNIRL_CHECK(width >= 160 && height >= 100, "plot_series: size ", width, " x ", height,
              ": expected at least 160 x 100 pixels");
  detail::rgb_image img(width, height);
#if UNIRL_HAS_STB
  detail::draw_panel(img, s, title, 0, 0, width, height);
#else
  (void)title;
#endif
  detail::write_png(png_path, img);
}

/// The curve of `key` against "step" (the row index when a row has no "step") from metrics
/// rows; rows without the key, or with a null there, leave a gap. Throws `unirl::error` naming
/// the key and the keys present when no row has it.
inline series metrics_series(const std::vector<nlohmann::json>& rows, const std::string& key,
                             const std::string& source = "the metrics") {
  series s{key, {}, {}};
  bool found = false;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    if (!r.is_object()) continue;
    const auto step = r.find("step");
    const double x = step != r.end() && step->is_number() ? step->get<double>() : static_cast<double>(i);
    const auto v = r.find(key);
    if (v == r.end()) continue;
    found = true;
    s.x.push_back(x);
    s.y.push_back(v->is_number() ? v->get<double>()
                  : v->is_boolean() ? (v->get<bool>() ? 1.0 : 0.0)
                                   : std::numeric_limits<double>::quiet_NaN());
  }
  if (!found) {
    std::vector<std::string> present;
    for (const auto& r : rows)
      if (r.is_object())
        for (auto it = r.begin(); it != r.end(); ++it)
          if (std::find(present.begin(), present.end(), it.key()) == present.end()) present.push_back(it.key());
    std::string list;
    for (const auto& k : present) list += (list.empty() ? "" : ", ") + k;
    throw error("plot_metrics: key '" + key + "' is in none of the " + std::to_string(rows.size()) + " rows of " +
                source + (list.empty() ? std::string{} : "; keys present: " + list));
  }
  return s;
}

/// Plots metrics written by `metrics_writer`: one panel per key, stacked vertically, x = "step".
inline void plot_metrics(const std::string& jsonl_path, const std::string& png_path,
                         const std::vector<std::string>& keys = {"reward_mean", "kl"}) {
  detail::require_stb("plot_metrics");
  UNIRL_CHECK(!keys.empty(), "plot_metrics: no keys given; expected at least one metric name");
  const auto rows = read_metrics(jsonl_path);
  std::vector<series> panels;
  for (const auto& k : keys) panels.push_back(metrics_series(rows, k, "'" + jsonl_path + "'"));
  const int width = 640, panel_height = 240;
  detail::rgb_image img(width, panel_height * static_cast<int>(panels.size()));
#if UNIRL_HAS_STB
  for (std::size_t i = 0; i < panels.size(); ++i)
    detail::draw_panel(img, {panels[i]}, panels[i].name, 0, static_cast<int>(i) * panel_height, width, panel_height);
#endif
  detail::write_png(png_path, img);
}

}  // namespace unirl::train
