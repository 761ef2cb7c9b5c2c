#pragma once
/// \file checkpoint.hpp
/// Checkpoint files: an atomic, checksummed envelope around a LibTorch archive, plus helpers
/// to put named tensors, the random generators and scalars into it. The trainer decides what
/// goes in; this header only guarantees that a file is either complete and verified or
/// rejected with a `unirl::checkpoint_error` that says why.
///
/// ```cpp
/// unirl::train::write_checkpoint("run/ckpt.pt", [&](torch::serialize::OutputArchive& a) {
///   unirl::train::save_tensors(a, "policy/", model.named_parameters());
///   unirl::train::write_scalar(a, "step", std::int64_t{42});
/// });
/// unirl::train::read_checkpoint("run/ckpt.pt", [&](torch::serialize::InputArchive& a) {
///   unirl::train::load_tensors(a, "policy/", model.named_parameters());
///   auto step = unirl::train::read_scalar<std::int64_t>(a, "step");
/// });
/// ```
///
/// File layout (little-endian), 32-byte header then the payload:
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | magic `UNIRLCK1` |
/// | 8 | 4 | format version (1) |
/// | 12 | 4 | reserved (0) |
/// | 16 | 8 | payload size in bytes |
/// | 24 | 8 | FNV-1a 64 of the payload |
/// | 32 | n | payload: `torch::serialize::OutputArchive::save_to` bytes (a TorchScript zip) |
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/checkpoint.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#define UNIRL_CHECKPOINT_POSIX 1
#endif

namespace unirl::train {

/// The magic bytes that open every unirl checkpoint file.
inline constexpr std::array<char, 8> checkpoint_magic{'U', 'N', 'I', 'R', 'L', 'C', 'K', '1'};
/// The envelope's format version written by this build (and the newest it reads).
inline constexpr std::uint32_t checkpoint_format_version = 1;
/// Size of the envelope header in bytes.
inline constexpr std::size_t checkpoint_header_size = 32;

namespace detail {
/// 64-bit FNV-1a of `n` bytes.
inline std::uint64_t fnv1a64(const char* data, std::size_t n) {
  std::uint64_t h = 14695981039346656037ull;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}
inline void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
inline std::uint64_t get_le(const char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
inline std::string hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}
// LibTorch errors carry a C++ backtrace; keep the message.
inline std::string torch_message(const c10::Error& e) { return e.what_without_backtrace(); }

// Writes `header` then `payload` to `path` and flushes them to the disk.
inline void write_file_synced(const std::string& path, const std::string& header, const std::string& payload) {
#if defined(UNIRL_CHECKPOINT_POSIX)
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw checkpoint_error("checkpoint '" + path + "': cannot open for writing: " +
                           std::error_code(errno, std::generic_category()).message());
  const std::size_t total = header.size() + payload.size();
  std::size_t done = 0;
  for (const std::string* part : {&header, &payload}) {
    std::size_t off = 0;
    while (off < part->size()) {
      const auto n = ::write(fd, part->data() + off, part->size() - off);
      if (n < 0) {
        if (errno == EINTR) continue;
        const auto msg = std::error_code(errno, std::generic_category()).message();
        ::close(fd);
        throw checkpoint_error("checkpoint '" + path + "': write failed after " + std::to_string(done) + " of " +
                               std::to_string(total) + " bytes: " + msg);
      }
      off += static_cast<std::size_t>(n);
      done += static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    const auto msg = std::error_code(errno, std::generic_category()).message();
    ::close(fd);
    throw checkpoint_error("checkpoint '" + path + "': fsync failed: " + msg);
  }
  if (::close(fd) != 0)
    throw checkpoint_error("checkpoint '" + path + "': close failed: " +
                           std::error_code(errno, std::generic_category()).message());
#else
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw checkpoint_error("checkpoint '" + path + "': cannot open for writing");
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
  out.flush();
  if (!out) throw checkpoint_error("checkpoint '" + path + "': write failed");
#endif
}

// Makes a rename durable by syncing the directory that holds it (POSIX only). Best effort where
// the file system cannot sync a directory (EINVAL, ENOTSUP); an I/O error (EIO) throws: the
// rename may not survive a power loss.
inline void sync_directory(const std::filesystem::path& dir) {
#if defined(UNIRL_CHECKPOINT_POSIX)
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY);
  if (fd >= 0) {
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0 && err == EIO)
      throw checkpoint_error("checkpoint directory '" + dir.string() + "': fsync after the rename failed: " +
                             std::error_code(err, std::generic_category()).message());
  }
#else
  (void)dir;
#endif
}
}  // namespace detail

/// Writes a checkpoint atomically. `fill` puts everything into a fresh archive; the archive's
/// bytes, behind the header described in the file comment, go to `path + ".tmp"`, which is
/// fsynced and then renamed over `path`. When `fill` throws or the write fails, `path` keeps
/// its previous content. Parent directories are created.
inline void write_checkpoint(const std::string& path,
                             const std::function<void(torch::serialize::OutputArchive&)>& fill) {
  UNIRL_CHECK(!path.empty(), "write_checkpoint: the path is empty; expected a file name");
  std::string payload;
  {
    torch::serialize::OutputArchive archive;
    fill(archive);  // may throw: nothing on disk has been touched yet
    try {
      archive.save_to([&payload](const void* data, std::size_t n) {
        payload.append(static_cast<const char*>(data), n);
        return n;
      });
    } catch (const c10::Error& e) {
      throw checkpoint_error("checkpoint '" + path + "': cannot serialise the archive: " +
                             detail::torch_message(e));
    }
  }
  std::string header;
  header.append(checkpoint_magic.data(), checkpoint_magic.size());
  detail::put_le(header, checkpoint_format_version, 4);
  detail::put_le(header, 0, 4);
  detail::put_le(header, payload.size(), 8);
  detail::put_le(header, detail::fnv1a64(payload.data(), payload.size()), 8);

  const std::filesystem::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    std::filesystem::create_directories(target.parent_path(), ec);
    if (ec)
      throw checkpoint_error("checkpoint '" + path + "': cannot create directory '" +
                             target.parent_path().string() + "': " + ec.message());
  }
  const std::string tmp = path + ".tmp";
  try {
    detail::write_file_synced(tmp, header, payload);
  } catch (...) {
    std::filesystem::remove(tmp, ec);
    throw;
  }
  std::filesystem::rename(tmp, target, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw checkpoint_error("checkpoint '" + path + "': cannot rename '" + tmp + "' over it: " + ec.message());
  }
  detail::sync_directory(target.parent_path());
}

/// Reads a checkpoint written by `write_checkpoint`, verifies its header, size and checksum,
/// then hands the archive to `read`. Throws `unirl::checkpoint_error` naming the path and the
/// cause: missing file, truncated header or payload ("truncated: 1234 of 5678 payload bytes"),
/// wrong magic, newer format, checksum mismatch, an unreadable archive, or an error of `read`.
inline void read_checkpoint(const std::string& path,
                            const std::function<void(torch::serialize::InputArchive&)>& read) {
  const auto fail = [&](const std::string& why) -> void {
    throw checkpoint_error("checkpoint '" + path + "': " + why);
  };
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    std::error_code ec;
    fail(std::filesystem::exists(path, ec) ? "cannot open for reading" : "no such file");
  }
  std::string bytes(static_cast<std::size_t>(in.tellg()), '\0');
  in.seekg(0);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) fail("read failed");
  if (bytes.size() < checkpoint_header_size)
    fail("truncated header: " + std::to_string(bytes.size()) + " of " +
         std::to_string(checkpoint_header_size) + " bytes");
  if (std::memcmp(bytes.data(), checkpoint_magic.data(), checkpoint_magic.size()) != 0)
    fail("not a unirl checkpoint (the file does not start with the magic 'UNIRLCK1')");
  const auto version = detail::get_le(bytes.data() + 8, 4);
  if (version == 0 || version > checkpoint_format_version)
    fail("format version " + std::to_string(version) + "; this build reads versions 1 to " +
         std::to_string(checkpoint_format_version));
  const auto size = detail::get_le(bytes.data() + 16, 8);
  const auto stored = detail::get_le(bytes.data() + 24, 8);
  const std::size_t have = bytes.size() - checkpoint_header_size;
  if (have < size)
    fail("truncated: " + std::to_string(have) + " of " + std::to_string(size) + " payload bytes");
  if (have > size)
    fail(std::to_string(have - size) + " unexpected bytes after the " + std::to_string(size) +
         "-byte payload");
  const char* payload = bytes.data() + checkpoint_header_size;
  const auto computed = detail::fnv1a64(payload, size);
  if (computed != stored)
    fail("checksum mismatch: the header says " + detail::hex(stored) + ", the payload hashes to " +
         detail::hex(computed) + " (the file is corrupted)");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(payload, size);
  } catch (const c10::Error& e) {
    fail("the payload is not a readable archive: " + detail::torch_message(e));
  } catch (const std::exception& e) {  // TorchScript's parser throws torch::jit::ErrorReport, not a c10::Error
    fail(std::string("the payload is not a readable archive: ") + e.what());
  }
  try {
    read(archive);
  } catch (const checkpoint_error& e) {
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    fail(what);
  } catch (const c10::Error& e) {
    fail(detail::torch_message(e));
  } catch (const std::exception& e) {  // e.g. torch::jit::ErrorReport from a record of a corrupted archive
    fail(e.what());
  }
}

/// Writes each tensor of `tensors` (detached, on the CPU) under `prefix + name`.
inline void save_tensors(torch::serialize::OutputArchive& a, const std::string& prefix,
                         const unirl::named_tensors& tensors) {
  for (const auto& [name, t] : tensors) {
    UNIRL_CHECK(t.defined(), "save_tensors: tensor '", prefix, name, "' is undefined");
    a.write(prefix + name, t.detach().cpu(), /*is_buffer=*/true);
  }
}

/// Copies the tensors stored under `prefix + name` into the existing tensors of `into` (their
/// device and dtype are kept; no autograd history is recorded). A missing key or a shape
/// mismatch throws `unirl::checkpoint_error` naming the tensor and both shapes.
inline void load_tensors(torch::serialize::InputArchive& a, const std::string& prefix,
                         const unirl::named_tensors& into) {
  const auto shape = [](const torch::Tensor& t) {
    std::string s = "[";
    for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
    return s + "]";
  };
  // Read all first: a failure leaves every destination tensor untouched.
  std::vector<torch::Tensor> read(into.size());
  for (std::size_t i = 0; i < into.size(); ++i) {
    const auto& [name, dst] = into[i];
    const auto key = prefix + name;
    if (!a.try_read(key, read[i], /*is_buffer=*/true))
      throw checkpoint_error("load_tensors: the checkpoint has no tensor '" + key + "'");
    if (read[i].sizes() != dst.sizes())
      throw checkpoint_error("load_tensors: tensor '" + key + "' has shape " + shape(read[i]) +
                             " in the checkpoint but " + shape(dst) + " here");
  }
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < into.size(); ++i) into[i].second.copy_(read[i]);
}

/// Writes the state of the default CPU generator (and of every CUDA device's when CUDA is
/// available) under `rng/...`.
inline void save_rng(torch::serialize::OutputArchive& a) {
  {
    at::Generator gen = at::globalContext().defaultGenerator(c10::DeviceType::CPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.write("rng/cpu", gen.get_state(), /*is_buffer=*/true);
  }
  const std::int64_t cuda = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
  a.write("rng/cuda_count", c10::IValue(cuda));
  for (std::int64_t i = 0; i < cuda; ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.write("rng/cuda" + std::to_string(i), gen.get_state(), /*is_buffer=*/true);
  }
}

/// Restores what `save_rng` wrote. CUDA states are restored for the devices present in both
/// the checkpoint and this process.
inline void load_rng(torch::serialize::InputArchive& a) {
  torch::Tensor state;
  if (!a.try_read("rng/cpu", state, true))
    throw checkpoint_error("load_rng: the checkpoint has no 'rng/cpu' generator state");
  {
    at::Generator gen = at::globalContext().defaultGenerator(c10::DeviceType::CPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  c10::IValue count;
  const std::int64_t saved = a.try_read("rng/cuda_count", count) && count.isInt() ? count.toInt() : 0;
  const std::int64_t here = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
  for (std::int64_t i = 0; i < std::min(saved, here); ++i) {
    torch::Tensor s;
    if (!a.try_read("rng/cuda" + std::to_string(i), s, true)) continue;
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s);
  }
}

/// Writes a scalar: `std::int64_t`, `double`, `bool` or `std::string` (e.g. options as JSON).
template <class T>
  requires std::is_same_v<T, std::int64_t> || std::is_same_v<T, double> ||
           std::is_same_v<T, bool> || std::is_same_v<T, std::string>
void write_scalar(torch::serialize::OutputArchive& a, const std::string& key, const T& value) {
  a.write(key, c10::IValue(value));
}
inline void write_scalar(torch::serialize::OutputArchive& a, const std::string& key, const char* value) {
  a.write(key, c10::IValue(std::string(value)));
}

/// Reads a scalar written by `write_scalar`; a missing key or another type throws
/// `unirl::checkpoint_error` naming the key.
template <class T>
  requires std::is_same_v<T, std::int64_t> || std::is_same_v<T, double> ||
           std::is_same_v<T, bool> || std::is_same_v<T, std::string>
T read_scalar(torch::serialize::InputArchive& a, const std::string& key) {
  c10::IValue v;
  if (!a.try_read(key, v)) throw checkpoint_error("read_scalar: the checkpoint has no entry '" + key + "'");
  if constexpr (std::is_same_v<T, std::int64_t>) {
    if (v.isInt()) return v.toInt();
  } else if constexpr (std::is_same_v<T, double>) {
    if (v.isDouble()) return v.toDouble();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (v.isBool()) return v.toBool();
  } else {
    if (v.isString()) return v.toStringRef();
  }
  throw checkpoint_error("read_scalar: entry '" + key + "' holds a " + v.tagKind() + ", not the type asked for");
}

/// True when the archive has an entry (scalar, tensor or nested archive) named `key`.
/// A string as a 1-D uint8 tensor (how the RL trainer stores its options in a checkpoint), and back.
inline torch::Tensor text_tensor(const std::string& s) {
  return torch::from_blob(const_cast<char*>(s.data()), {static_cast<std::int64_t>(s.size())}, torch::kUInt8).clone();
}
inline std::string tensor_text(const torch::Tensor& t) {
  auto c = t.contiguous();
  return std::string(reinterpret_cast<const char*>(c.data_ptr<std::uint8_t>()), static_cast<std::size_t>(c.numel()));
}

inline bool has_key(torch::serialize::InputArchive& a, const std::string& key) {
  for (const auto& k : a.keys())
    if (k == key) return true;
  return false;
}

/// Reads the tensor stored under `key`; a missing key throws `unirl::checkpoint_error` naming it
/// and `what` (e.g. "vector_env").
inline torch::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& what) {
  torch::Tensor t;
  if (!a.try_read(key, t, /*is_buffer=*/true))
    throw checkpoint_error(what + ": the checkpoint has no tensor '" + key + "'");
  return t;
}

/// Reads the nested archive stored under `key`; a missing key throws `unirl::checkpoint_error`
/// naming it and `what`.
inline torch::serialize::InputArchive read_archive(torch::serialize::InputArchive& a, const std::string& key,
                                                   const std::string& what) {
  torch::serialize::InputArchive sub;
  if (!has_key(a, key) || !a.try_read(key, sub))
    throw checkpoint_error(what + ": the checkpoint has no entry '" + key + "'");
  return sub;
}

/// Writes each of `extras` (objects with `save(OutputArchive&) const`, `Checkpointable`) under
/// "extra.0", "extra.1", ... and their count under "unirl.extras": the trainers' extra states
/// (a data set's position, a vector environment), restored by `read_extras` from the same positions.
template <class... Extras>
void write_extras(torch::serialize::OutputArchive& a, const Extras&... extras) {
  write_scalar(a, "unirl.extras", static_cast<std::int64_t>(sizeof...(Extras)));
  std::size_t i = 0;
  (
      [&] {
        torch::serialize::OutputArchive sub;
        extras.save(sub);
        a.write("extra." + std::to_string(i++), sub);
      }(),
      ...);
}

/// Throws `checkpoint_error` (prefixed `who`) unless the checkpoint holds exactly `given` extras
/// (checkpoints of older builds: none), naming the ones that would be lost or are missing.
inline void check_extras(torch::serialize::InputArchive& a, std::int64_t given, const std::string& who) {
  const std::int64_t stored = has_key(a, "unirl.extras") ? read_scalar<std::int64_t>(a, "unirl.extras") : 0;
  if (stored == given) return;
  const auto names = [](std::int64_t from, std::int64_t to) {
    std::string s;
    for (std::int64_t i = from; i < to; ++i) s += (i > from ? ", " : "") + ("extra." + std::to_string(i));
    return s;
  };
  if (stored > given)
    throw checkpoint_error(who + ": the checkpoint holds " + std::to_string(stored) +
                           " extra state(s) saved with the model (e.g. a data set's position or the vector_env), "
                           "but load was given " +
                           std::to_string(given) + ": " + names(given, stored) +
                           " would be lost; pass the same objects to load(path, ...) as to save(path, ...)");
  throw checkpoint_error(who + ": load was given " + std::to_string(given) +
                         " extra state(s), but the checkpoint holds " + std::to_string(stored) + ": " +
                         names(stored, given) + " is missing from the checkpoint; pass the same objects to "
                         "load(path, ...) as to save(path, ...)");
}

/// Restores each of `extras` from what `write_extras` stored at the same position. Call
/// `check_extras` first (before anything else is changed) so a mismatch changes nothing.
template <class... Extras>
void read_extras(torch::serialize::InputArchive& a, const std::string& who, Extras&... extras) {
  std::size_t i = 0;
  (
      [&] {
        auto sub = read_archive(a, "extra." + std::to_string(i++), who);
        extras.load(sub);
      }(),
      ...);
}

/// One checkpoint file for `state` (anything with `save(OutputArchive&) const`: a trainer, a
/// `joint::chain`, a `joint::multitask`) and its `extras` (`Checkpointable`), written atomically
/// by `write_checkpoint`: what `save(path, extras...)` of a composition of trainers does.
template <class State, class... Extras>
void save_with_extras(const std::string& path, const State& state, const Extras&... extras) {
  write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
    state.save(a);
    write_extras(a, extras...);
  });
}

/// Restores what `save_with_extras` wrote into `state` and `extras`: the extras' count is checked
/// first (a mismatch changes nothing), errors are prefixed `who`.
template <class State, class... Extras>
void load_with_extras(const std::string& path, State& state, const std::string& who, Extras&... extras) {
  read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
    check_extras(a, static_cast<std::int64_t>(sizeof...(Extras)), who);
    state.load(a);
    read_extras(a, who, extras...);
  });
}

}  // namespace unirl::train

// The Checkpointable concept: concepts/checkpoint.hpp.
