#pragma once
/// \file memory.hpp
/// Memory settings of the trainer (`trainer_options::memory`) and the memory tracker behind the
/// step statistics' `memory/*` figures.
///
/// ```cpp
/// unirl::trainer<...>::options o{.memory = {.checkpointing = {"decoder_blocks"},
///                                           .reference_device = "cpu", .logprob_chunk = 16}};
/// auto s = t.step(prompts);
/// s.extra["memory/update_peak_mb"];   // resident set (CPU) at its highest during the update
///
/// unirl::train::memory_tracker m(torch::kCPU);
/// m.start();
/// run_something();
/// auto f = m.stop();                  // f.current_mb, f.peak_mb
/// ```
/// On the CPU the figures are the process's resident set: the current one from
/// `/proc/self/statm`, the peak of a stage from `VmHWM` in `/proc/self/status`, which `start()`
/// resets (writing "5" to `/proc/self/clear_refs`, Linux >= 4.0). Where the peak cannot be reset
/// (another system, a restricted /proc) the peak of a stage is the larger of its two ends, and
/// `exact_peak` is false. On CUDA (the CUDA build, `UNIRL_WITH_CUDA_KERNELS`), the caching
/// allocator's allocated bytes (current and peak, whose peak `start()` resets) and reserved bytes
/// are reported besides.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if defined(UNIRL_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::train {

/// What the trainer does to fit a model in memory.
struct memory_options {
  /// Module kinds whose activations are recomputed in the backward (activation checkpointing,
  /// models/activation_checkpoint.hpp): "decoder_blocks" (gpt, hf::causal_lm), "flow_blocks"
  /// (the flow nets), or a kind a model of one's own offers. Empty: none.
  std::vector<std::string> checkpointing{};
  /// Where the frozen reference model lives: "" (the training device) or a device ("cpu" keeps
  /// it off the accelerator; its log-probs are computed there, `logprob_chunk` rows at a time).
  std::string reference_device{};
  /// Sequences per chunk of the no-grad log-prob forwards of a rollout (reference and pi_old);
  /// 0: the whole rollout at once.
  std::int64_t logprob_chunk = 0;
  /// Memory figures per loop stage in the step statistics (`memory/<stage>_mb`, `..._peak_mb`).
  bool track = true;

  void validate(const std::string& p) const {
    options::require(logprob_chunk >= 0, p + "logprob_chunk", logprob_chunk, ">= 0 (0: all sequences at once)");
    for (const auto& k : checkpointing)
      options::require(!k.empty(), p + "checkpointing", std::string("\"\""), "non-empty module kinds");
    if (!reference_device.empty()) {
      try {
        (void)torch::Device(reference_device);
      } catch (const std::exception&) {
        throw config_error(p + "reference_device", "value \"" + reference_device +
                                                       "\" is not a device: expected empty (the training device), "
                                                       "cpu, cuda or cuda:N");
      }
    }
  }
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::memory_options, checkpointing, reference_device, logprob_chunk, track);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::train::memory_options>{
    unirl::options::field_doc{"checkpointing", "module kinds whose activations are recomputed in the backward (e.g. decoder_blocks)"},
    unirl::options::field_doc{"reference_device", "device of the frozen reference model; empty = the training device"},
    unirl::options::field_doc{"logprob_chunk", "sequences per chunk of the no-grad log-prob forwards; 0 = all at once"},
    unirl::options::field_doc{"track", "memory figures per stage in the metrics"}};

namespace unirl::train {

/// The process's resident set in bytes (`/proc/self/statm`); 0 where it cannot be read.
inline std::int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
#if defined(__unix__) || defined(__APPLE__)
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
#else
  return resident * 4096;
#endif
}

/// The highest resident set since the start or the last `reset_peak_resident()` (`VmHWM`), in
/// bytes; 0 where it cannot be read.
inline std::int64_t peak_resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream in(line.substr(6));
      std::int64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  return 0;
}

/// Resets the peak resident set to the current one (Linux: "5" into /proc/self/clear_refs).
/// False where it cannot.
inline bool reset_peak_resident() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

/// Memory of one stage, in MiB.
struct memory_figures {
  double current_mb = 0;     // resident set at the end of the stage
  double peak_mb = 0;        // highest resident set during the stage
  bool exact_peak = false;   // false: the peak is the larger of the stage's ends (no resettable peak)
  bool has_device = false;   // the CUDA figures below are set
  double device_mb = 0;          // caching allocator: allocated at the end of the stage
  double device_peak_mb = 0;     // ... highest allocated during the stage
  double device_reserved_mb = 0; // ... reserved (held by the cache) at the end
};

/// Measures the memory of consecutive stages: `start()` before one, `stop()` after it (which
/// also starts the next one: `lap`).
class memory_tracker {
 public:
  explicit memory_tracker(torch::Device device = torch::kCPU) : device_(device) {}

  /// Begins a stage: resets the peaks.
  void start() {
    exact_ = reset_peak_resident();
    start_bytes_ = resident_bytes();
#if defined(UNIRL_WITH_CUDA_KERNELS)
    if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device_index());
#endif
  }

  /// Ends the stage begun by `start()`.
  memory_figures stop() const {
    constexpr double mb = 1024.0 * 1024.0;
    memory_figures f;
    const auto now = resident_bytes();
    f.current_mb = static_cast<double>(now) / mb;
    const auto hwm = exact_ ? peak_resident_bytes() : 0;
    f.exact_peak = exact_ && hwm > 0;
    f.peak_mb = static_cast<double>(f.exact_peak ? std::max(hwm, now) : std::max(start_bytes_, now)) / mb;
#if defined(UNIRL_WITH_CUDA_KERNELS)
    if (device_.is_cuda()) {
      const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(device_index());
      f.has_device = true;
      f.device_mb = static_cast<double>(st.allocated_bytes[0].current) / mb;  // [0]: all pools
      f.device_peak_mb = static_cast<double>(st.allocated_bytes[0].peak) / mb;
      f.device_reserved_mb = static_cast<double>(st.reserved_bytes[0].current) / mb;
    }
#endif
    return f;
  }

  /// Ends the current stage, writes its figures into `extra` as `memory/<stage>_mb`,
  /// `memory/<stage>_peak_mb` (and `memory/<stage>_device_mb`, `..._device_peak_mb`,
  /// `..._device_reserved_mb` on CUDA), and begins the next stage.
  void lap(std::map<std::string, double>& extra, const std::string& stage) {
    const auto f = stop();
    const std::string k = "memory/" + stage;
    extra[k + "_mb"] = f.current_mb;
    extra[k + "_peak_mb"] = f.peak_mb;
    if (f.has_device) {
      extra[k + "_device_mb"] = f.device_mb;
      extra[k + "_device_peak_mb"] = f.device_peak_mb;
      extra[k + "_device_reserved_mb"] = f.device_reserved_mb;
    }
    start();
  }

 private:
  c10::DeviceIndex device_index() const {
#if defined(UNIRL_WITH_CUDA_KERNELS)
    if (device_.has_index()) return device_.index();
    return c10::cuda::current_device();
#else
    return device_.has_index() ? device_.index() : 0;
#endif
  }

  torch::Device device_;
  bool exact_ = false;
  std::int64_t start_bytes_ = 0;
};

/// Bytes of the parameters and buffers of a model (anything with `named_parameters()` and
/// `named_buffers()` as `TrainableModule`s have them).
template <class M>
std::int64_t state_bytes(const M& m) {
  std::int64_t n = 0;
  for (const auto& [name, t] : m.named_parameters()) {
    (void)name;
    n += static_cast<std::int64_t>(t.numel()) * static_cast<std::int64_t>(t.element_size());
  }
  for (const auto& [name, t] : m.named_buffers()) {
    (void)name;
    n += static_cast<std::int64_t>(t.numel()) * static_cast<std::int64_t>(t.element_size());
  }
  return n;
}

}  // namespace unirl::train
