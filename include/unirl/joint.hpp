#pragma once
/// \file joint.hpp
/// Joint training as composition of trainers (docs/joint.md): a chain of models in one step (a
/// language model writing the condition a flow model draws from, `joint::link` / `joint::chain`)
/// with staged schedules and one checkpoint, and several tasks of any track in one run with
/// fixed or progress-driven sampling weights (`joint::multitask`). Bring the tracks you chain
/// with it (`<unirl/token.hpp>`, `<unirl/flow.hpp>`, ...).
///
/// ```cpp
/// #include <unirl/flow.hpp>
/// #include <unirl/joint.hpp>
/// #include <unirl/token.hpp>
/// using gen_t = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, image_reward>;
/// using link_t = unirl::joint::link<gen_t, decode_fn>;
/// using lm_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, link_t>;
/// gen_t gen{flow, image_reward{}, {.group_size = 4}};
/// lm_t lm{gpt, link_t{gen, decode_fn{}}, {.group_size = 8}};
/// unirl::joint::chain c{lm, gen, {.stages = {{"lm", 20, unirl::joint::stage_mode::upstream},
///                                            {"both", 0, unirl::joint::stage_mode::joint}}}};
/// auto s = c.step(prompts);
/// ```
#include <unirl/trainer.hpp>

#include <unirl/concepts/joint.hpp>
#include <unirl/joint/chain.hpp>
#include <unirl/joint/link.hpp>
#include <unirl/joint/multitask.hpp>
