#pragma once
// The learner / sampler split of the examples (docs/parallel.md, "Learner / sampler split"):
// `mode=colocated|split`, `max_staleness=K`, `partial=0|1` and `split_timeout=SECONDS` are taken off the command
// line before the example parses its own options — a colocated run's options, outputs and summary
// stay exactly what they were — and the c10d rollout transport is made from torchrun's variables
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; `unirl-launch --nproc N -- prog ...` or torchrun
// set them). Rank 0 learns, ranks 1.. sample and score.
//
//   auto split = examples::take_split_mode(argc, argv);        // before parse_command_line
//   if (split.sampler()) { auto tr = examples::split_transport<unirl::token_rollout>(split); ... }
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/parallel/c10d_transport.hpp>

namespace examples {

struct split_mode {
  bool split = false;              // mode=split
  std::int64_t max_staleness = 0;  // 0: synchronous; k > 0: samplers run up to k versions ahead
  double timeout_s = 600;          // every wait of the transport (rank 0 pretrains meanwhile)
  bool partial = false;            // partial=1: partial rollouts (worker_options::partial_rollouts; token samplers)
  int rank = 0, world_size = 1;    // RANK, WORLD_SIZE (split only)

  bool learner() const { return split && rank == 0; }
  bool sampler() const { return split && rank != 0; }
  int samplers() const { return world_size - 1; }
  /// Batches one learner step takes: one per sampler when synchronous, else the next one.
  std::int64_t parts() const { return max_staleness == 0 ? samplers() : 1; }
  nlohmann::json to_json() const {
    return {{"mode", split ? "split" : "colocated"},
            {"max_staleness", max_staleness},
            {"samplers", samplers()},
            {"partial", partial}};
  }
};

namespace detail {
inline std::int64_t split_integer(const std::string& key, const std::string& text) {
  try {
    std::size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw unirl::config_error(key, "value '" + text + "': expected an integer");
}
inline int split_env(const char* name) {
  const char* v = std::getenv(name);
  UNIRL_CHECK(v != nullptr, "mode=split: environment variable ", name,
              " is not set; expected the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): start "
              "the processes with unirl-launch --nproc N -- PROGRAM ... or torchrun");
  return static_cast<int>(split_integer(name, v));
}
}  // namespace detail

/// Removes `mode=...`, `max_staleness=...`, `partial=...` and `split_timeout=...` from the command line (argc
/// shrinks) and returns them; with mode=split, reads RANK and WORLD_SIZE (at least 2: one learner,
/// one sampler).
inline split_mode take_split_mode(int& argc, char** argv) {
  split_mode m;
  bool staleness_given = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.starts_with("mode=")) {
      const auto v = a.substr(5);
      if (v != "split" && v != "colocated")
        throw unirl::config_error("mode", "value '" + v + "': expected colocated or split");
      m.split = v == "split";
    } else if (a.starts_with("max_staleness=")) {
      m.max_staleness = detail::split_integer("max_staleness", a.substr(14));
      UNIRL_CHECK(m.max_staleness >= 0, "max_staleness = ", m.max_staleness, ": expected >= 0 (0: synchronous)");
      staleness_given = true;
    } else if (a.starts_with("partial=")) {
      const auto v = detail::split_integer("partial", a.substr(8));
      if (v != 0 && v != 1) throw unirl::config_error("partial", "value '" + a.substr(8) + "': expected 0 or 1");
      m.partial = v == 1;
    } else if (a.starts_with("split_timeout=")) {
      m.timeout_s = static_cast<double>(detail::split_integer("split_timeout", a.substr(14)));
      UNIRL_CHECK(m.timeout_s > 0, "split_timeout = ", m.timeout_s, ": expected > 0 seconds");
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  UNIRL_CHECK(m.split || !staleness_given, "max_staleness = ", m.max_staleness,
              ": only with mode=split (the colocated loop is always on-policy)");
  UNIRL_CHECK(!m.partial || (m.split && m.max_staleness >= 1), "partial = 1: partial rollouts need mode=split ",
              "with max_staleness >= 1 (sequences go on under newer weights); got ",
              m.split ? "max_staleness = " + std::to_string(m.max_staleness) : std::string("mode=colocated"));
  if (m.split) {
    m.rank = detail::split_env("RANK");
    m.world_size = detail::split_env("WORLD_SIZE");
    UNIRL_CHECK(m.world_size >= 2, "mode=split: WORLD_SIZE = ", m.world_size,
                ": expected >= 2 (rank 0 learns, ranks 1.. sample)");
    UNIRL_CHECK(m.rank >= 0 && m.rank < m.world_size, "mode=split: RANK = ", m.rank, ": expected in [0, ",
                m.world_size, ")");
    // Several processes share the machine's cores: one LibTorch thread each. With a thread per
    // core in every process, the OpenMP workers of one process spin while another's hold the
    // cores (measured on 2 cores with LibTorch 2.6: a smoke run of digits_flow took 118 s
    // instead of 2). A program may still raise it afterwards (the quickstart's `threads`).
    torch::set_num_threads(1);
  }
  return m;
}

/// The c10d rollout transport of this process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Gloo
/// binds to the loopback interface when MASTER_ADDR is a loopback address (one machine), else
/// to the machine's hostname.
template <class Batch>
unirl::parallel::c10d_transport<Batch> split_transport(const split_mode& m) {
  unirl::parallel::transport_options o{.max_staleness = m.max_staleness};
  o.rdzv.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(m.timeout_s * 1000));
  const char* addr = std::getenv("MASTER_ADDR");
  const std::string a = addr ? addr : "127.0.0.1";
  if (a == "127.0.0.1" || a == "localhost" || a == "::1") o.rdzv.interface_host = "127.0.0.1";
  return unirl::parallel::c10d_transport<Batch>::from_environment(std::move(o));
}

}  // namespace examples
