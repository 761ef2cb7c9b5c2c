#pragma once
/// \file vision_cache.hpp
/// `vlm::vision_cache`: the per-step image table of a vision-language model (`vlm::vlm`). An
/// image registered with `add` takes the next slot s and is written into a prompt as its
/// image-slot ids — n_s copies of `vocab_size + s`, n_s its number of feature rows — so every
/// row of every batch carries which image it shows. The vision tower encodes a slot once, on
/// first use and without gradient; the features are kept here and reused by every later forward
/// (the G samples of a group, pi_old, the reference, the update), and by every copy of the model
/// (`clone()` shares the table through a `std::shared_ptr`).
///
/// ```cpp
/// auto& images = model.images();              // the model's table (shared with its clones)
/// images.clear();                             // a new step: a new table
/// auto slot = images.add(pixels);             // (C, H, W) -> {V + 0, V + 0, ..., V + 0} (n_0 ids)
/// std::vector<std::int64_t> prompt = {bos};
/// prompt.insert(prompt.end(), slot.begin(), slot.end());
/// images.vision_tower_calls();                // images encoded so far (all copies together)
/// ```
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/vision/config.hpp>

namespace unirl::models::vlm {

/// The image table of one step and its vision-feature cache (see the file comment).
class vision_cache {
 public:
  /// Counters since construction (`clear` keeps them).
  struct counters {
    std::int64_t encoded = 0;     // images encoded without gradient and cached
    std::int64_t recomputed = 0;  // images encoded again with gradient (a trained vision tower's update forward)
    std::int64_t reused = 0;      // (forward, image) pairs served from the cache
  };

  /// A table for a language model of `vocab_size` tokens and a vision tower of config `vision`
  /// whose features are chosen by `strategy` (which decides n_s).
  vision_cache(std::int64_t vocab_size, vision::vision_config vision,
               vision::select_strategy strategy = vision::select_strategy::drop_first)
      : vocab_(vocab_size), vision_(std::move(vision)), strategy_(strategy) {
    UNIRL_CHECK(vocab_ >= 1, "vlm::vision_cache: vocab_size = ", vocab_, ": expected >= 1");
  }

  /// Registers an image (C, H, W) or (1, C, H, W) — floating point, C = num_channels, H and W
  /// multiples of patch_size of at most image_size — in the next slot s and returns its
  /// image-slot ids: n_s copies of `vocab_size() + s`. Nothing is encoded yet.
  std::vector<std::int64_t> add(torch::Tensor image) {
    UNIRL_CHECK(image.defined(), "vlm::vision_cache::add: the image is an undefined tensor; expected (C, H, W)");
    if (image.dim() == 4 && image.size(0) == 1) image = image.squeeze(0);
    UNIRL_CHECK(image.dim() == 3, "vlm::vision_cache::add: image of sizes ", image.sizes(),
                ": expected (C, H, W) or (1, C, H, W)");
    UNIRL_CHECK(image.is_floating_point(), "vlm::vision_cache::add: image of dtype ", image.scalar_type(),
                ": expected floating-point pixel values");
    const auto C = image.size(0), H = image.size(1), W = image.size(2), p = vision_.patch_size;
    UNIRL_CHECK(C == vision_.num_channels, "vlm::vision_cache::add: image has ", C,
                " channels: expected num_channels = ", vision_.num_channels);
    UNIRL_CHECK(H >= p && W >= p && H % p == 0 && W % p == 0 && H <= vision_.image_size && W <= vision_.image_size,
                "vlm::vision_cache::add: image of ", H, " x ", W, " pixels: expected multiples of patch_size = ", p,
                " from ", p, " to image_size = ", vision_.image_size);
    const auto n = (H / p) * (W / p) + (vision_.is_siglip() ? 0 : 1) -
                   (strategy_ == vision::select_strategy::drop_first ? 1 : 0);
    UNIRL_CHECK(n >= 1, "vlm::vision_cache::add: the image has no feature rows under this select strategy");
    const auto s = static_cast<std::int64_t>(slots_.size());
    slots_.push_back({image.detach(), n, {}});
    return std::vector<std::int64_t>(static_cast<std::size_t>(n), vocab_ + s);
  }

  /// Forgets every image and its features (a new step's table); the counters keep running.
  void clear() { slots_.clear(); }

  /// Images registered.
  std::int64_t size() const { return static_cast<std::int64_t>(slots_.size()); }
  bool empty() const { return slots_.empty(); }
  /// The language model's vocabulary: ids >= it are image-slot tokens.
  std::int64_t vocab_size() const { return vocab_; }
  /// The image-slot id of slot s: vocab_size() + s.
  std::int64_t token_id(std::int64_t slot) const { return vocab_ + check_slot(slot); }
  /// Feature rows n_s of slot s (the length of its run of image-slot ids).
  std::int64_t tokens(std::int64_t slot) const { return slots_[static_cast<std::size_t>(check_slot(slot))].tokens; }
  /// The image of slot s as registered.
  const torch::Tensor& image(std::int64_t slot) const {
    return slots_[static_cast<std::size_t>(check_slot(slot))].image;
  }
  const vision::vision_config& vision() const { return vision_; }
  vision::select_strategy strategy() const { return strategy_; }

  /// Images the vision tower encoded (cached, plus recomputed with gradient), all copies of the
  /// model together, since construction.
  std::int64_t vision_tower_calls() const { return counts_.encoded + counts_.recomputed; }
  const counters& counts() const { return counts_; }
  /// `vision_tower_calls()` since the previous call of this function (the trainer's step
  /// statistics report it through `vlm::report_stats`).
  std::int64_t take_vision_tower_calls() {
    const auto now = vision_tower_calls(), d = now - reported_;
    reported_ = now;
    return d;
  }

  // ---- used by the models (vlm, vlm_critic) ------------------------------------------------

  /// An id for a vision tower whose features differ from every other's (a trainable copy).
  std::uint64_t new_tower_id() { return next_tower_id_++; }

  /// The cached features of `slot` computed by tower `tower` at parameter version `version`
  /// (-1: a frozen tower, whose features do not change), or nullptr.
  const torch::Tensor* find(std::int64_t slot, std::uint64_t tower, std::int64_t version) const {
    for (const auto& e : slots_[static_cast<std::size_t>(slot)].features)
      if (e.tower == tower && e.version == version) return &e.features;
    return nullptr;
  }
  /// Keeps `features` (n_s, hidden) of `slot` for tower `tower` at `version` (replacing that tower's older ones).
  void store(std::int64_t slot, std::uint64_t tower, std::int64_t version, torch::Tensor features) {
    auto& fs = slots_[static_cast<std::size_t>(slot)].features;
    for (auto& e : fs)
      if (e.tower == tower) {
        e = {tower, version, std::move(features)};
        return;
      }
    fs.push_back({tower, version, std::move(features)});
  }
  void count_encoded(std::int64_t n) { counts_.encoded += n; }
  void count_recomputed(std::int64_t n) { counts_.recomputed += n; }
  void count_reused(std::int64_t n) { counts_.reused += n; }

 private:
  struct entry {
    std::uint64_t tower = 0;
    std::int64_t version = -1;
    torch::Tensor features;
  };
  struct slot_data {
    torch::Tensor image;
    std::int64_t tokens = 0;
    std::vector<entry> features;
  };
  std::int64_t check_slot(std::int64_t s) const {
    UNIRL_CHECK(s >= 0 && s < size(), "vlm::vision_cache: slot ", s, " is not registered: the table holds ", size(),
                " image(s)");
    return s;
  }

  std::int64_t vocab_;
  vision::vision_config vision_;
  vision::select_strategy strategy_;
  std::vector<slot_data> slots_;
  counters counts_{};
  std::int64_t reported_ = 0;
  std::uint64_t next_tower_id_ = 0;
};

}  // namespace unirl::models::vlm
