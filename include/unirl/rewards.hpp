#pragma once
/// \file rewards.hpp
/// The rewards of every track: the `weighted<...>` composer, rule rewards (exact answer, regex,
/// length, IoU, BLEU), embedding alignment, learned reward models, the scorer concepts and the
/// client of a remote reward service. Hosting a service is `<unirl/rewards/server.hpp>`; the env
/// track's own reward comes with `<unirl/env.hpp>`.
///
/// ```cpp
/// #include <unirl/rewards.hpp>
/// unirl::rewards::weighted<exact_answer, format_ok> reward{{.weights = {1.0, 0.2}}, exact_answer{}, format_ok{}};
/// ```
#include <unirl/concepts/reward.hpp>
#include <unirl/rewards/actions.hpp>
#include <unirl/rewards/alignment.hpp>
#include <unirl/rewards/clip.hpp>
#include <unirl/rewards/consistency.hpp>
#include <unirl/rewards/model.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/scorer.hpp>
#include <unirl/rewards/weighted.hpp>
