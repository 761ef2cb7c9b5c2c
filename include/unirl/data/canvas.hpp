#pragma once
/// \file canvas.hpp
/// Canvases of real digits for the vision-language tasks (grounding "where is the 7?", the click
/// agent, VQA "which digit is this?"): `digit_canvas` places 1..3 digit images (8x8, e.g. the
/// UCI / scikit-learn digits of examples/data/digits.csv.gz) at random non-overlapping places of
/// a square canvas, optionally scaled by an integer factor, from a seeded generator, and returns
/// the image with the labels and the boxes. `box_text` writes a box as the rewards read it
/// (rewards::iou_reward, rewards::click_reward: the first four numbers of the text), and
/// `save_canvas_grid` draws canvases with true and predicted boxes and clicks into a PNG.
///
/// ```cpp
/// auto d = examples::load_digits(path);                          // (N, 1, 8, 8), (N,)
/// unirl::data::digit_canvas make(d.images, d.labels, {.size = 32, .max_digits = 3, .max_scale = 2});
/// unirl::data::canvas c = make(42);                              // the same canvas for seed 42, always
/// c.image;                                                       // (1, 32, 32) float in [0, 1]
/// c.labels[0], c.boxes[0];                                       // e.g. 7, {3, 10, 19, 26}
/// std::string answer = unirl::data::box_text(c.boxes[0]);        // "[3, 10, 19, 26]"
/// unirl::data::canvas one = make.digit(5);                       // digit 5 alone: (1, 8, 8), VQA
/// unirl::data::save_canvas_grid("grid.png", {c.image}, {{predicted}}, {c.boxes}, {{{12.0, 20.0}}});
/// ```
/// Boxes are pixel corners (x1, y1, x2, y2) with x2 = x1 + width: the box covers pixels
/// x1 .. x2-1 (x to the right, y down), the cell the digit was drawn in (8 * scale square).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/plot.hpp>

namespace unirl::data {

/// A box in pixels: corners (x1, y1) inclusive, (x2, y2) exclusive.
struct pixel_box {
  std::int64_t x1 = 0, y1 = 0, x2 = 0, y2 = 0;

  std::int64_t width() const { return x2 - x1; }
  std::int64_t height() const { return y2 - y1; }
  /// True when the point lies in the box: x1 <= x < x2 and y1 <= y < y2.
  bool contains(double x, double y) const { return x >= x1 && x < x2 && y >= y1 && y < y2; }
  /// True when the boxes share a pixel.
  bool overlaps(const pixel_box& o) const { return x1 < o.x2 && o.x1 < x2 && y1 < o.y2 && o.y1 < y2; }
  bool operator==(const pixel_box&) const = default;
};

/// How `box_text` writes a box.
enum class box_style { brackets, corners };

/// "[x1, y1, x2, y2]" (brackets) or "(x1,y1),(x2,y2)" (corners): both read back by
/// rewards::iou_reward as the box (x1, y1, x2, y2) (its `xyxy` format).
inline std::string box_text(const pixel_box& b, box_style style = box_style::brackets) {
  const auto s = [](std::int64_t v) { return std::to_string(v); };
  if (style == box_style::corners) return "(" + s(b.x1) + "," + s(b.y1) + "),(" + s(b.x2) + "," + s(b.y2) + ")";
  return "[" + s(b.x1) + ", " + s(b.y1) + ", " + s(b.x2) + ", " + s(b.y2) + "]";
}

/// Writes the box as `box_text` does ("[x1, y1, x2, y2]").
inline std::ostream& operator<<(std::ostream& os, const pixel_box& b) { return os << box_text(b); }

/// Settings of a `digit_canvas`.
struct canvas_options {
  std::int64_t size = 32;          // canvas height = width, pixels
  std::int64_t min_digits = 1;     // digits per canvas: uniform in [min_digits, max_digits]
  std::int64_t max_digits = 3;
  std::int64_t min_scale = 1;      // each digit drawn at an integer scale in [min_scale, max_scale]
  std::int64_t max_scale = 1;      // (nearest neighbour: an 8x8 digit at scale 2 is 16x16)
  bool distinct_labels = true;     // the digits of one canvas have different labels ("where is the 7?" has one answer)

  void validate(const std::string& prefix) const {
    options::require(size >= 8 && size <= 4096, prefix + "size", size, "in [8, 4096]");
    options::require(min_digits >= 1, prefix + "min_digits", min_digits, ">= 1");
    options::require(max_digits >= min_digits && max_digits <= 10, prefix + "max_digits", max_digits,
                     "in [min_digits, 10]");
    options::require(min_scale >= 1, prefix + "min_scale", min_scale, ">= 1");
    options::require(max_scale >= min_scale, prefix + "max_scale", max_scale, ">= min_scale");
    const auto cells = size / (8 * max_scale);
    options::require(cells * cells >= max_digits, prefix + "size", size,
                     "room for max_digits digits at max_scale (" + std::to_string(max_digits) + " cells of " +
                         std::to_string(8 * max_scale) + " pixels)");
  }
};

}  // namespace unirl::data
BOOST_HANA_ADAPT_STRUCT(unirl::data::canvas_options, size, min_digits, max_digits, min_scale, max_scale,
                        distinct_labels);
namespace unirl::data {

/// One canvas: the image, and each digit's label, box and index in the digit set.
struct canvas {
  torch::Tensor image;                 // (1, H, W) float32 in [0, 1]
  std::vector<std::int64_t> labels;    // one per digit, 0..9
  std::vector<pixel_box> boxes;        // one per digit, in pixels
  std::vector<std::int64_t> sources;   // one per digit: its index in the digit set
};

/// Generator of canvases from a set of digit images; deterministic in its seed.
class digit_canvas {
 public:
  /// `images`: (N, 1, 8, 8) or (N, 8, 8) floats in [0, 1]; `labels`: (N,) integers in 0..9.
  digit_canvas(const torch::Tensor& images, const torch::Tensor& labels, canvas_options o = {}) : opts_(std::move(o)) {
    unirl::options::validate(opts_);
    UNIRL_CHECK(images.defined() && labels.defined(), "digit_canvas: undefined images or labels");
    UNIRL_CHECK((images.dim() == 4 && images.size(1) == 1 && images.size(2) == 8 && images.size(3) == 8) ||
                    (images.dim() == 3 && images.size(1) == 8 && images.size(2) == 8),
                "digit_canvas: images of shape ", images.sizes(), ": expected (N, 1, 8, 8) or (N, 8, 8)");
    UNIRL_CHECK(images.size(0) >= 1 && labels.dim() == 1 && labels.size(0) == images.size(0) && !labels.is_floating_point(),
                "digit_canvas: ", images.size(0), " images and labels of shape ", labels.sizes(), " and type ",
                labels.scalar_type(), ": expected one integer label per image");
    images_ = images.detach().to(torch::kCPU, torch::kFloat).reshape({images.size(0), 8, 8}).contiguous();
    UNIRL_CHECK(torch::isfinite(images_).all().item<bool>(), "digit_canvas: the images have non-finite pixels");
    const auto l = labels.detach().to(torch::kCPU, torch::kLong).contiguous();
    labels_.assign(l.data_ptr<std::int64_t>(), l.data_ptr<std::int64_t>() + l.numel());
    for (std::size_t i = 0; i < labels_.size(); ++i) {
      UNIRL_CHECK(labels_[i] >= 0 && labels_[i] <= 9, "digit_canvas: label ", i, " = ", labels_[i], ": expected 0..9");
      by_label_[static_cast<std::size_t>(labels_[i])].push_back(static_cast<std::int64_t>(i));
    }
    std::int64_t present = 0;
    for (const auto& v : by_label_) present += !v.empty();
    UNIRL_CHECK(!opts_.distinct_labels || present >= opts_.max_digits, "digit_canvas: the images have ", present,
                " distinct labels; expected at least max_digits = ", opts_.max_digits, " with distinct_labels");
  }

  const canvas_options& options() const { return opts_; }
  std::int64_t size() const { return opts_.size; }
  /// Number of digit images in the set.
  std::int64_t num_digits() const { return static_cast<std::int64_t>(labels_.size()); }

  /// The canvas of `seed` (the same canvas for the same seed and digit set, on every platform).
  canvas operator()(std::uint64_t seed) const {
    std::mt19937_64 rng(seed);
    return draw(rng);
  }

  /// A canvas drawn from `rng`.
  canvas draw(std::mt19937_64& rng) const {
    const auto S = opts_.size;
    const auto k = uniform(rng, opts_.min_digits, opts_.max_digits);
    canvas c;
    c.image = torch::zeros({1, S, S});
    // Which digits: k distinct labels (or any k images), then one image of each.
    std::vector<std::int64_t> chosen;
    if (opts_.distinct_labels) {
      std::vector<std::int64_t> present;
      for (std::int64_t d = 0; d < 10; ++d)
        if (!by_label_[static_cast<std::size_t>(d)].empty()) present.push_back(d);
      for (std::int64_t i = 0; i < k; ++i) {  // partial Fisher-Yates
        const auto j = uniform(rng, i, static_cast<std::int64_t>(present.size()) - 1);
        std::swap(present[static_cast<std::size_t>(i)], present[static_cast<std::size_t>(j)]);
        const auto& imgs = by_label_[static_cast<std::size_t>(present[static_cast<std::size_t>(i)])];
        chosen.push_back(imgs[static_cast<std::size_t>(uniform(rng, 0, static_cast<std::int64_t>(imgs.size()) - 1))]);
      }
    } else {
      for (std::int64_t i = 0; i < k; ++i) chosen.push_back(uniform(rng, 0, num_digits() - 1));
    }
    std::vector<std::int64_t> scales;
    for (std::int64_t i = 0; i < k; ++i) scales.push_back(uniform(rng, opts_.min_scale, opts_.max_scale));
    // Places: rejection sampling; after 200 tries for one digit, the grid of max-scale cells.
    std::vector<pixel_box> boxes;
    bool placed = true;
    for (std::int64_t i = 0; i < k && placed; ++i) {
      const auto side = 8 * scales[static_cast<std::size_t>(i)];
      placed = false;
      for (int t = 0; t < 200 && !placed; ++t) {
        const auto x = uniform(rng, 0, S - side), y = uniform(rng, 0, S - side);
        const pixel_box b{x, y, x + side, y + side};
        if (std::none_of(boxes.begin(), boxes.end(), [&](const pixel_box& o) { return o.overlaps(b); })) {
          boxes.push_back(b);
          placed = true;
        }
      }
    }
    if (!placed) {
      boxes.clear();
      const auto cell = 8 * opts_.max_scale, per_row = S / cell;
      std::vector<std::int64_t> cells(static_cast<std::size_t>(per_row * per_row));
      for (std::size_t i = 0; i < cells.size(); ++i) cells[i] = static_cast<std::int64_t>(i);
      for (std::int64_t i = 0; i < k; ++i) {
        const auto j = uniform(rng, i, static_cast<std::int64_t>(cells.size()) - 1);
        std::swap(cells[static_cast<std::size_t>(i)], cells[static_cast<std::size_t>(j)]);
        const auto side = 8 * scales[static_cast<std::size_t>(i)];
        const auto x = (cells[static_cast<std::size_t>(i)] % per_row) * cell;
        const auto y = (cells[static_cast<std::size_t>(i)] / per_row) * cell;
        boxes.push_back({x, y, x + side, y + side});
      }
    }
    for (std::int64_t i = 0; i < k; ++i) {
      const auto& b = boxes[static_cast<std::size_t>(i)];
      const auto src = chosen[static_cast<std::size_t>(i)];
      c.image[0].slice(0, b.y1, b.y2).slice(1, b.x1, b.x2).copy_(scaled(src, scales[static_cast<std::size_t>(i)]));
      c.labels.push_back(labels_[static_cast<std::size_t>(src)]);
      c.sources.push_back(src);
    }
    c.boxes = std::move(boxes);
    return c;
  }

  /// Digit `index` of the set alone (VQA "which digit is this?"): a (1, 8s, 8s) image whose box is
  /// the whole image.
  canvas digit(std::int64_t index, std::int64_t scale = 1) const {
    UNIRL_CHECK(index >= 0 && index < num_digits(), "digit_canvas::digit: index = ", index, ": expected in [0, ",
                num_digits(), ")");
    UNIRL_CHECK(scale >= 1 && scale <= 64, "digit_canvas::digit: scale = ", scale, ": expected in [1, 64]");
    canvas c;
    c.image = scaled(index, scale).unsqueeze(0).clone();
    c.labels = {labels_[static_cast<std::size_t>(index)]};
    c.boxes = {{0, 0, 8 * scale, 8 * scale}};
    c.sources = {index};
    return c;
  }

  /// A random single digit from `seed` (uniform over the set) at a scale in [min_scale, max_scale].
  canvas single(std::uint64_t seed) const {
    std::mt19937_64 rng(seed);
    const auto index = uniform(rng, 0, num_digits() - 1);
    return digit(index, uniform(rng, opts_.min_scale, opts_.max_scale));
  }

 private:
  // Uniform integer in [lo, hi] from the generator's raw output (the same on every standard library).
  static std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
    const auto span = static_cast<std::uint64_t>(hi - lo) + 1;
    return lo + static_cast<std::int64_t>(rng() % span);
  }
  torch::Tensor scaled(std::int64_t index, std::int64_t s) const {
    const auto img = images_[index];
    return s == 1 ? img : img.repeat_interleave(s, 0).repeat_interleave(s, 1);
  }

  canvas_options opts_;
  torch::Tensor images_;                // (N, 8, 8) float
  std::vector<std::int64_t> labels_;
  std::array<std::vector<std::int64_t>, 10> by_label_{};
};

/// A point (a click) in pixels.
struct pixel_point {
  double x = 0.0, y = 0.0;
};

/// Settings of `save_canvas_grid`.
struct canvas_grid_options {
  std::int64_t zoom = 4;      // screen pixels per canvas pixel
  std::int64_t columns = 8;   // canvases per row
  std::int64_t gap = 4;       // screen pixels between canvases

  void validate(const std::string& prefix) const {
    options::require(zoom >= 1 && zoom <= 64, prefix + "zoom", zoom, "in [1, 64]");
    options::require(columns >= 1, prefix + "columns", columns, ">= 1");
    options::require(gap >= 0 && gap <= 256, prefix + "gap", gap, "in [0, 256]");
  }
};

}  // namespace unirl::data
BOOST_HANA_ADAPT_STRUCT(unirl::data::canvas_grid_options, zoom, columns, gap);
namespace unirl::data {

/// Colours of `save_canvas_grid`: true boxes green, predicted boxes red, clicks blue.
inline constexpr std::array<std::uint8_t, 3> canvas_true_colour{0, 200, 0};
inline constexpr std::array<std::uint8_t, 3> canvas_pred_colour{230, 0, 0};
inline constexpr std::array<std::uint8_t, 3> canvas_click_colour{0, 90, 255};

/// Writes a PNG of `images` ((1, H, W) or (H, W) floats in [0, 1], grey) in a grid, each zoomed,
/// with its true boxes (green outlines), predicted boxes (red) and clicks (blue crosses) drawn
/// on top. `boxes_pred`, `boxes_true`, `clicks`: one list per image, or empty for none. Needs
/// unirl built with stb (as train/plot.hpp); without it, throws saying so.
inline void save_canvas_grid(const std::string& path, const std::vector<torch::Tensor>& images,
                             const std::vector<std::vector<pixel_box>>& boxes_pred,
                             const std::vector<std::vector<pixel_box>>& boxes_true,
                             const std::vector<std::vector<pixel_point>>& clicks, const canvas_grid_options& o = {}) {
  train::detail::require_stb("save_canvas_grid");
  unirl::options::validate(o);
  const auto n = static_cast<std::int64_t>(images.size());
  UNIRL_CHECK(n >= 1, "save_canvas_grid: no images; expected at least one");
  for (const auto* v : {&boxes_pred, &boxes_true})
    UNIRL_CHECK(v->empty() || static_cast<std::int64_t>(v->size()) == n, "save_canvas_grid: ", v->size(),
                " lists of boxes for ", n, " images; expected one per image or none");
  UNIRL_CHECK(clicks.empty() || static_cast<std::int64_t>(clicks.size()) == n, "save_canvas_grid: ", clicks.size(),
              " lists of clicks for ", n, " images; expected one per image or none");
  std::vector<torch::Tensor> imgs;
  std::int64_t H = 0, W = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    auto t = images[static_cast<std::size_t>(i)];
    UNIRL_CHECK(t.defined() && (t.dim() == 2 || (t.dim() == 3 && t.size(0) == 1)) && t.numel() > 0,
                "save_canvas_grid: image ", i, " of shape ", t.defined() ? t.sizes() : torch::IntArrayRef{},
                ": expected (1, H, W) or (H, W)");
    t = t.detach().to(torch::kCPU, torch::kFloat).reshape({t.size(-2), t.size(-1)}).nan_to_num(0.0).clamp(0.0, 1.0).contiguous();
    H = std::max(H, t.size(0));
    W = std::max(W, t.size(1));
    imgs.push_back(t);
  }
  UNIRL_CHECK(H * o.zoom <= 8192 && W * o.zoom <= 8192, "save_canvas_grid: images up to ", H, "x", W, " at zoom ",
              o.zoom, ": expected at most 8192 screen pixels a side");
  const auto cols = std::min(o.columns, n), rows = (n + cols - 1) / cols;
  const auto cw = W * o.zoom, ch = H * o.zoom;
  const auto gw = cols * cw + (cols + 1) * o.gap, gh = rows * ch + (rows + 1) * o.gap;
  UNIRL_CHECK(gw <= 32768 && gh <= 32768, "save_canvas_grid: a grid of ", gw, "x", gh,
              " pixels; expected at most 32768 a side (fewer images or a smaller zoom)");
  train::detail::rgb_image out(static_cast<int>(gw), static_cast<int>(gh));
  const auto zoom = static_cast<int>(o.zoom);
  for (std::int64_t i = 0; i < n; ++i) {
    const int ox = static_cast<int>(o.gap + (i % cols) * (cw + o.gap)), oy = static_cast<int>(o.gap + (i / cols) * (ch + o.gap));
    const auto& t = imgs[static_cast<std::size_t>(i)];
    const float* px = t.data_ptr<float>();
    for (std::int64_t y = 0; y < t.size(0); ++y)
      for (std::int64_t x = 0; x < t.size(1); ++x) {
        // Ink dark on white: 1 -> black.
        const auto v = static_cast<std::uint8_t>(std::lround(255.0 * (1.0 - px[y * t.size(1) + x])));
        out.fill(ox + static_cast<int>(x) * zoom, oy + static_cast<int>(y) * zoom, ox + static_cast<int>(x + 1) * zoom,
                 oy + static_cast<int>(y + 1) * zoom, {v, v, v});
      }
    // Outlines on the box's border pixels (clamped to the image), two screen pixels thick.
    auto outline = [&](const pixel_box& b, const std::array<std::uint8_t, 3>& c) {
      const auto cl = [](std::int64_t v, std::int64_t hi) { return std::clamp<std::int64_t>(v, 0, hi); };
      const int x1 = ox + static_cast<int>(cl(b.x1, t.size(1)) * zoom), x2 = ox + static_cast<int>(cl(b.x2, t.size(1)) * zoom);
      const int y1 = oy + static_cast<int>(cl(b.y1, t.size(0)) * zoom), y2 = oy + static_cast<int>(cl(b.y2, t.size(0)) * zoom);
      if (x2 <= x1 || y2 <= y1) return;
      out.fill(x1, y1, x2, y1 + 2, c);
      out.fill(x1, y2 - 2, x2, y2, c);
      out.fill(x1, y1, x1 + 2, y2, c);
      out.fill(x2 - 2, y1, x2, y2, c);
    };
    if (!boxes_true.empty())
      for (const auto& b : boxes_true[static_cast<std::size_t>(i)]) outline(b, canvas_true_colour);
    if (!boxes_pred.empty())
      for (const auto& b : boxes_pred[static_cast<std::size_t>(i)]) outline(b, canvas_pred_colour);
    if (!clicks.empty())
      for (const auto& p : clicks[static_cast<std::size_t>(i)]) {
        if (!(p.x >= 0 && p.y >= 0 && p.x < static_cast<double>(t.size(1)) && p.y < static_cast<double>(t.size(0))))
          continue;  // off the image (or NaN): not drawn
        const int cx = ox + static_cast<int>(p.x * zoom), cy = oy + static_cast<int>(p.y * zoom), r = 2 * zoom;
        out.fill(cx - r, cy - 1, cx + r + 1, cy + 2, canvas_click_colour);
        out.fill(cx - 1, cy - r, cx + 2, cy + r + 1, canvas_click_colour);
      }
  }
  train::detail::write_png(path, out);
}

}  // namespace unirl::data
