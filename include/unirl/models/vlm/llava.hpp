#pragma once
/// \file llava.hpp
/// A LLaVA checkpoint (`vision::load_llava`) as a trainable `vlm::vlm<hf::causal_lm>`: its
/// vision_feature_layer and vision_feature_select_strategy become the model's options, its
/// parameter names stay LLaVA's (`vision_tower.*`, `multi_modal_projector.*`, `language_model.*`).
///
/// ```cpp
/// namespace vlm = unirl::models::vlm;
/// auto parts = unirl::models::vision::load_llava("llava-1.5-7b-hf");
/// auto model = vlm::from_llava(parts);                 // the tower frozen
/// auto ids = vlm::place_images(prompt_ids, parts.config.image_token_index, {model.images().add(pixels)});
/// ```
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/vision/llava.hpp>
#include <unirl/models/vlm/vlm.hpp>

namespace unirl::models::vlm {

/// The parts of a loaded LLaVA model as one `vlm` (sharing their weights).
inline vlm<hf::causal_lm> from_llava(const vision::llava_parts& m, bool freeze_vision_tower = true) {
  return vlm<hf::causal_lm>(m.vision_tower, m.projector, m.language_model,
                            vlm_options{.vision_feature_layer = m.config.vision_feature_layer,
                                        .vision_feature_select_strategy = m.config.vision_feature_select_strategy,
                                        .freeze_vision_tower = freeze_vision_tower});
}

}  // namespace unirl::models::vlm
