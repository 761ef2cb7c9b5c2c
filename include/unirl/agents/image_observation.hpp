#pragma once
/// \file image_observation.hpp
/// Observations with images, for a vision-language policy (`models::vlm::vlm<LM>`) acting over
/// several turns: an environment whose `reset` returns an `image_observation` and whose `step`
/// returns an `image_step` is still a `TextEnvironment` (both convert to the text types, images
/// dropped), and `run_episodes` reads their images. The i-th `image_marker` in the text is
/// where `images[i]` goes: the rollout registers each image in the policy's image table once
/// and puts its image-slot ids there, so the G episodes of a task share their first image, and
/// every later forward (the engine's resumed chunks, the update, the reference) reads the
/// vision tower's features from the table's cache.
///
/// ```cpp
/// struct screen_env {
///   unirl::agents::image_observation reset(std::uint64_t seed) {
///     return {.text = "Open the settings page.\n<image>", .images = {render(page_)}};
///   }
///   unirl::agents::image_step step(const std::string& action) {
///     apply(action);
///     return {.observation = {.text = "<image>", .images = {render(page_)}}, .reward = done() ? 1.0 : 0.0, .done = done()};
///   }
/// };
/// static_assert(unirl::TextEnvironment<screen_env>);
/// ```
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>

namespace unirl::agents {

/// Where an observation's text shows an image (the i-th marker: `images[i]`).
inline constexpr std::string_view image_marker = "<image>";

/// A `text_observation` that shows images (each (C, H, W), one per `image_marker` in `text`).
struct image_observation {
  std::string text{};
  std::vector<std::int64_t> tokens{};  // token ids instead of text (no images then)
  std::vector<torch::Tensor> images{};

  operator text_observation() const { return {.text = text, .tokens = tokens}; }
};

/// A `text_step` whose observation shows images.
struct image_step {
  image_observation observation{};
  double reward = 0.0;
  bool done = false;

  operator text_step() const { return {.observation = observation, .reward = reward, .done = done}; }
};

/// Context text with its images as token ids — what `run_episodes` appends for an observation:
/// the text between `image_marker`s tokenized on its own by `encode` (string -> ids), each image
/// registered in `model`'s image table (`images().add`) and its image-slot ids in its marker's
/// place. A demonstration laid out with it has the layout of a rollout of the same turns.
/// Throws naming the counts when markers and images do not pair up.
template <class M, class Encode>
  requires requires(const M& m, const torch::Tensor& t) { m.images().add(t); }
std::vector<std::int64_t> encode_with_images(const M& model, Encode&& encode, const std::string& text,
                                             const std::vector<torch::Tensor>& images) {
  std::vector<std::string> parts;  // the text around the markers: parts.size() - 1 markers
  for (std::size_t at = 0;;) {
    const auto m = text.find(image_marker, at);
    parts.push_back(text.substr(at, m == std::string::npos ? std::string::npos : m - at));
    if (m == std::string::npos) break;
    at = m + image_marker.size();
  }
  const auto markers = parts.size() - 1;
  UNIRL_CHECK(markers == images.size(), "encode_with_images: ", images.size(), " image(s) but the text has ", markers,
              " ", image_marker, " marker(s); expected one marker per image");
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].empty()) {
      const std::vector<std::int64_t> ids = encode(parts[i]);
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (i < markers) {  // registered only once the text pairs up with the images
      const auto slot = model.images().add(images[i]);
      out.insert(out.end(), slot.begin(), slot.end());
    }
  }
  return out;
}

}  // namespace unirl::agents
