#pragma once
/// \file safetensors.hpp
/// Reading and writing safetensors files and Hugging Face checkpoints (one `model.safetensors`, or
/// `model.safetensors.index.json` + shards) as LibTorch tensors.
///
/// ```cpp
/// namespace io = unirl::io;
/// io::safetensors_checkpoint ckpt("path/to/hf-model");               // file, or directory (sharded or not)
/// torch::Tensor w = ckpt.tensor("model.embed_tokens.weight");         // CPU; zero-copy view of the mapping
/// auto report = io::load_into(named_parameters_and_buffers, ckpt);    // bf16 file -> f32 parameters, checked
/// io::save_safetensors("out/model.safetensors", {{"w", w}}, {{"step", "100"}});
/// io::save_safetensors_sharded("out/", tensors, 5'000'000'000);       // HF layout: shards + index.json
/// ```
/// Reading maps the file (mmap, private copy-on-write, so the file is never written) and validates
/// the whole header first (see safetensors_header.hpp): a file that lies is a `format_error` naming
/// it and the problem, never a crash. A tensor whose bytes are aligned for its type (every tensor of
/// a file written by the official library or by unirl) is a view of the mapping that keeps it alive;
/// otherwise it is copied once. Writing lays tensors out as the official writer does (descending
/// alignment, then name), pads the header with spaces to a multiple of 8, and replaces the file
/// atomically (temporary file + rename). POSIX only (mmap).
#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/io/safetensors_header.hpp>

namespace unirl::io {

namespace detail {

/// A read-only view of a whole file: mmap'ed private (copy-on-write), unmapped with the last owner.
struct st_mapping {
  unsigned char* data = nullptr;
  std::size_t size = 0;
  bool writable = false;  // in-place writes to zero-copy tensors stay private to the process
  st_mapping() = default;
  st_mapping(const st_mapping&) = delete;
  st_mapping& operator=(const st_mapping&) = delete;
  ~st_mapping() {
    if (data != nullptr) ::munmap(data, size);
  }
};

inline std::string st_errno() { return std::strerror(errno); }

inline std::shared_ptr<st_mapping> st_map_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) st_fail(path.string(), "cannot open: " + st_errno());
  struct fd_closer {
    int fd;
    ~fd_closer() { ::close(fd); }
  } closer{fd};
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) st_fail(path.string(), "cannot stat: " + st_errno());
  if (!S_ISREG(sb.st_mode)) st_fail(path.string(), "not a regular file");
  auto m = std::make_shared<st_mapping>();
  m->size = static_cast<std::size_t>(sb.st_size);
  if (m->size == 0) return m;
  // Private and writable: a caller writing into a zero-copy tensor gets its own page copy instead
  // of SIGSEGV; the file is opened read-only and never changes. MAP_NORESERVE keeps a checkpoint
  // larger than RAM + swap mappable; if the kernel refuses, fall back to read-only pages.
  void* p = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
  m->writable = p != MAP_FAILED;
  if (p == MAP_FAILED) p = ::mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) st_fail(path.string(), "cannot mmap " + std::to_string(m->size) + " bytes: " + st_errno());
  m->data = static_cast<unsigned char*>(p);
  return m;
}

/// The LibTorch type of a file dtype; `format_error` naming file and tensor for the ones LibTorch lacks.
inline torch::ScalarType st_to_torch(st_dtype d, const std::string& file, const std::string& name) {
  switch (d) {
    case st_dtype::F64: return torch::kFloat64;
    case st_dtype::F32: return torch::kFloat32;
    case st_dtype::F16: return torch::kFloat16;
    case st_dtype::BF16: return torch::kBFloat16;
    case st_dtype::I64: return torch::kInt64;
    case st_dtype::I32: return torch::kInt32;
    case st_dtype::I16: return torch::kInt16;
    case st_dtype::I8: return torch::kInt8;
    case st_dtype::U8: return torch::kUInt8;
    case st_dtype::BOOL: return torch::kBool;
    default: break;
  }
  st_fail(file, "tensor " + st_quote(name) + " has dtype " + st_dtype_name(d) +
                    ", which this LibTorch has no tensor type for (supported: F64, F32, F16, BF16, I64, I32, I16, "
                    "I8, U8, BOOL)");
}

/// The file dtype of a LibTorch type; `unirl::error` naming the tensor for the others.
inline st_dtype st_from_torch(torch::ScalarType t, const std::string& name) {
  switch (t) {
    case torch::kFloat64: return st_dtype::F64;
    case torch::kFloat32: return st_dtype::F32;
    case torch::kFloat16: return st_dtype::F16;
    case torch::kBFloat16: return st_dtype::BF16;
    case torch::kInt64: return st_dtype::I64;
    case torch::kInt32: return st_dtype::I32;
    case torch::kInt16: return st_dtype::I16;
    case torch::kInt8: return st_dtype::I8;
    case torch::kUInt8: return st_dtype::U8;
    case torch::kBool: return st_dtype::BOOL;
    default: break;
  }
  throw unirl::error("unirl: save_safetensors: tensor " + st_quote(name) + " has dtype " +
                     std::string(c10::toString(t)) +
                     ": expected one of float64, float32, float16, bfloat16, int64, int32, int16, int8, uint8, bool");
}

/// Reverses the bytes of each `size`-byte element (big-endian hosts only).
inline void st_swap_bytes(unsigned char* p, std::size_t n_elements, std::size_t size) {
  for (std::size_t i = 0; i < n_elements; ++i) std::reverse(p + i * size, p + (i + 1) * size);
}

}  // namespace detail

/// One safetensors file, memory-mapped. Cheap to copy (the mapping is shared).
class safetensors_file {
 public:
  explicit safetensors_file(const std::filesystem::path& path)
      : path_(path), map_(detail::st_map_file(path)),
        header_(std::make_shared<const st_header>(
            parse_safetensors_header(map_->data, map_->size, map_->size, path.string()))) {
    index_.reserve(header_->entries.size());
    for (std::size_t i = 0; i < header_->entries.size(); ++i) index_.emplace(header_->entries[i].name, i);
  }

  const std::filesystem::path& path() const { return path_; }
  /// Tensor names in file order (ascending data offsets).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(header_->entries.size());
    for (const auto& e : header_->entries) out.push_back(e.name);
    return out;
  }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  std::size_t size() const { return header_->entries.size(); }
  const st_header& header() const { return *header_; }
  const std::map<std::string, std::string>& metadata() const { return header_->metadata; }

  /// Dtype, shape and offsets of `name`; `format_error` naming the file and the tensor when absent.
  const st_entry& info(const std::string& name) const {
    const auto it = index_.find(name);
    if (it == index_.end())
      detail::st_fail(path_.string(), "no tensor " + detail::st_quote(name) + " (the file holds " +
                                          std::to_string(size()) + " tensors)");
    return header_->entries[it->second];
  }

  /// The tensor `name` on the CPU: a view of the mapping (which it keeps alive) when its bytes
  /// are aligned for its type on a little-endian host, else a copy. Writing into a view changes
  /// this process's private copy of the page (seen by other views of it), never the file.
  torch::Tensor tensor(const std::string& name) const {
    const auto& e = info(name);
    const auto dtype = detail::st_to_torch(e.dtype, path_.string(), e.name);
    const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCPU);
    if (e.begin == e.end) return torch::empty(e.shape, opts);
    unsigned char* p = map_->data + header_->data_offset + e.begin;
    const auto n = static_cast<std::size_t>(e.nbytes());
    if (e.dtype == st_dtype::BOOL)  // LibTorch assumes 0/1 bytes for bool
      for (std::size_t i = 0; i < n; ++i)
        if (p[i] > 1)
          detail::st_fail(path_.string(), "tensor " + detail::st_quote(e.name) + " (BOOL) holds the byte " +
                                              std::to_string(p[i]) + " at element " + std::to_string(i) +
                                              ": expected 0 or 1");
    const auto item = st_dtype_size(e.dtype);
    constexpr bool little = std::endian::native == std::endian::little;
    if (little && reinterpret_cast<std::uintptr_t>(p) % item == 0) {
      auto keep = map_;
      return torch::from_blob(p, e.shape, [keep](void*) {}, opts);
    }
    auto t = torch::empty(e.shape, opts);
    std::memcpy(t.data_ptr(), p, n);
    if (!little) detail::st_swap_bytes(static_cast<unsigned char*>(t.data_ptr()), n / item, item);
    return t;
  }

  /// The mapped bytes of the whole file (for inspection; tensors are views into it).
  const unsigned char* mapped_data() const { return map_->data; }
  std::size_t mapped_size() const { return map_->size; }

 private:
  std::filesystem::path path_;
  std::shared_ptr<detail::st_mapping> map_;
  std::shared_ptr<const st_header> header_;
  std::unordered_map<std::string, std::size_t> index_;
};

/// A checkpoint: one .safetensors file; a `model.safetensors.index.json` (the path of the index or
/// of its directory) with its shards; or a directory holding `model.safetensors` (preferred, as
/// transformers does) or the index.
class safetensors_checkpoint {
 public:
  explicit safetensors_checkpoint(const std::filesystem::path& file_or_dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path index;
    if (fs::is_directory(file_or_dir, ec)) {
      if (fs::is_regular_file(file_or_dir / "model.safetensors", ec)) {
        add_single(file_or_dir / "model.safetensors");
        return;
      }
      index = file_or_dir / "model.safetensors.index.json";
      if (!fs::is_regular_file(index, ec))
        throw format_error("unirl: safetensors checkpoint " + detail::st_quote(file_or_dir.string(), 4096) +
                           ": the directory holds neither model.safetensors nor model.safetensors.index.json");
    } else if (file_or_dir.extension() == ".json") {
      index = file_or_dir;
    } else {
      add_single(file_or_dir);
      return;
    }
    add_sharded(index);
  }

  /// Every tensor name: shard by shard (in shard file name order), each in file order.
  std::vector<std::string> names() const { return names_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const st_entry& info(const std::string& name) const { return file(name).info(name); }
  torch::Tensor tensor(const std::string& name) const { return file(name).tensor(name); }
  /// The file holding `name`, or the checkpoint's path (index or file) when none does.
  std::string file_of(const std::string& name) const {
    const auto it = where_.find(name);
    return it == where_.end() ? source_.string() : files_[it->second].path().string();
  }
  /// The path the checkpoint was opened from (the index file for a sharded one).
  const std::filesystem::path& source() const { return source_; }
  const std::vector<safetensors_file>& files() const { return files_; }

 private:
  const safetensors_file& file(const std::string& name) const {
    const auto it = where_.find(name);
    if (it == where_.end())
      throw format_error("unirl: safetensors checkpoint " + detail::st_quote(source_.string(), 4096) +
                         ": no tensor " + detail::st_quote(name) + " (it holds " + std::to_string(names_.size()) +
                         " tensors)");
    return files_[it->second];
  }

  void add_single(const std::filesystem::path& p) {
    source_ = p;
    files_.emplace_back(p);
    names_ = files_.back().names();
    for (const auto& n : names_) where_.emplace(n, 0);
  }

  void add_sharded(const std::filesystem::path& index_path) {
    source_ = index_path;
    const auto src = index_path.string();
    std::ifstream in(index_path, std::ios::binary);
    if (!in) throw format_error("unirl: safetensors index " + detail::st_quote(src, 4096) + ": cannot open");
    in.seekg(0, std::ios::end);
    const auto len = static_cast<std::uint64_t>(std::max<std::streamoff>(in.tellg(), 0));
    if (len > st_max_header_bytes)
      throw format_error("unirl: safetensors index " + detail::st_quote(src, 4096) + ": " + std::to_string(len) +
                         " bytes, above the " + std::to_string(st_max_header_bytes) + "-byte limit");
    in.seekg(0);
    std::string text(static_cast<std::size_t>(len), '\0');
    in.read(text.data(), static_cast<std::streamsize>(len));
    const auto idx = parse_safetensors_index(text, src);

    std::map<std::string, std::vector<std::string>> by_shard;  // shard -> names the index puts there
    for (const auto& [name, shard] : idx.weight_map) by_shard[shard].push_back(name);
    const auto dir = index_path.parent_path();
    for (const auto& [shard, listed] : by_shard) {
      std::error_code ec;
      if (!std::filesystem::is_regular_file(dir / shard, ec))
        throw format_error("unirl: safetensors index " + detail::st_quote(src, 4096) + ": shard " +
                           detail::st_quote(shard) + " (of tensor " + detail::st_quote(listed.front()) +
                           ") is not a file at " + detail::st_quote((dir / shard).string(), 4096));
    }
    for (const auto& [shard, listed] : by_shard) {
      const auto path = dir / shard;
      const auto k = files_.size();
      files_.emplace_back(path);
      const auto& f = files_.back();
      for (const auto& name : listed)
        if (!f.contains(name))
          detail::st_fail(path.string(), "no tensor " + detail::st_quote(name) + ", which the index " +
                                             detail::st_quote(src, 4096) + " places in this shard");
      for (const auto& name : f.names()) {
        const auto it = idx.weight_map.find(name);
        if (it == idx.weight_map.end() || it->second != shard)
          detail::st_fail(path.string(),
                          "holds tensor " + detail::st_quote(name) + ", which the index " + detail::st_quote(src, 4096) +
                              (it == idx.weight_map.end() ? " does not list" : " places in " + detail::st_quote(it->second)));
        names_.push_back(name);
        where_.emplace(name, k);
      }
    }
  }

  std::filesystem::path source_;
  std::vector<safetensors_file> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, std::size_t> where_;  // name -> files_ index
};

/// Every tensor of a file or checkpoint directory, by name (CPU; zero-copy views where aligned).
inline std::map<std::string, torch::Tensor> load_safetensors(const std::filesystem::path& file_or_dir) {
  const safetensors_checkpoint ckpt(file_or_dir);
  std::map<std::string, torch::Tensor> out;
  for (const auto& n : ckpt.names()) out.emplace(n, ckpt.tensor(n));
  return out;
}

namespace detail {

struct st_out_tensor {
  std::string name;
  const torch::Tensor* tensor;
  st_dtype dtype;
  std::uint64_t nbytes;
};

inline std::string st_json_string(const std::string& s, const std::string& what) {
  if (utf8_invalid_at(reinterpret_cast<const unsigned char*>(s.data()), s.size()) != s.size())
    throw unirl::error("unirl: save_safetensors: " + what + " " + st_quote(s) + " is not valid UTF-8");
  return nlohmann::json(s).dump();  // escapes as serde_json does: \" \\ \b \f \n \r \t, other controls \u00XX
}

/// Checks the tensors and lays them out as the official writer does.
inline std::vector<st_out_tensor> st_layout(const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  std::vector<st_out_tensor> out;
  out.reserve(tensors.size());
  std::unordered_set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__")
      throw unirl::error("unirl: save_safetensors: the tensor name '__metadata__' is reserved by the format");
    if (!seen.insert(name).second)
      throw unirl::error("unirl: save_safetensors: the tensor name " + st_quote(name) + " appears twice");
    if (!t.defined()) throw unirl::error("unirl: save_safetensors: tensor " + st_quote(name) + " is undefined");
    if (t.layout() != torch::kStrided)
      throw unirl::error("unirl: save_safetensors: tensor " + st_quote(name) + " is not dense (layout " +
                         c10::str(t.layout()) + "): expected a strided tensor");
    const auto d = st_from_torch(t.scalar_type(), name);
    out.push_back({name, &t, d, static_cast<std::uint64_t>(t.numel()) * st_dtype_size(d)});
  }
  // Descending alignment, then name (byte order), as the official writer: every tensor aligned.
  std::sort(out.begin(), out.end(), [](const st_out_tensor& a, const st_out_tensor& b) {
    const int ra = st_dtype_rank(a.dtype), rb = st_dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  return out;
}

/// The header bytes (JSON padded with spaces to a multiple of 8), compact like serde_json.
inline std::string st_header_bytes(const std::vector<st_out_tensor>& layout,
                                   const std::map<std::string, std::string>& metadata) {
  std::string h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      h += (first ? "" : ",") + st_json_string(k, "metadata key") + ":" + st_json_string(v, "metadata value of " + k);
      first = false;
    }
    h += "}";
  }
  std::uint64_t offset = 0;
  for (const auto& t : layout) {
    if (h.size() > 1) h += ",";
    h += st_json_string(t.name, "tensor name") + ":{\"dtype\":\"" + st_dtype_name(t.dtype) + "\",\"shape\":[";
    for (std::int64_t i = 0; i < t.tensor->dim(); ++i) {
      if (i > 0) h += ',';
      h += std::to_string(t.tensor->size(i));
    }
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.nbytes) + "]}";
    offset += t.nbytes;
  }
  h += "}";
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

/// A file descriptor written in full or not at all: a temporary next to the target, renamed over it.
class st_atomic_file {
 public:
  explicit st_atomic_file(const std::filesystem::path& target) : target_(target) {
    static std::atomic<unsigned> counter{0};
    std::error_code ec;
    if (target.has_parent_path() && !std::filesystem::is_directory(target.parent_path(), ec) &&
        !std::filesystem::create_directories(target.parent_path(), ec))
      throw unirl::error("unirl: save_safetensors " + st_quote(target_.string(), 4096) +
                         ": cannot create the directory: " + ec.message());
    tmp_ = target;
    tmp_ += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create " + tmp_.string());
  }
  st_atomic_file(const st_atomic_file&) = delete;
  st_atomic_file& operator=(const st_atomic_file&) = delete;
  ~st_atomic_file() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      const auto w = ::write(fd_, p, std::min<std::size_t>(n, std::size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("cannot write " + tmp_.string());
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) fail("cannot sync " + tmp_.string());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close " + tmp_.string());
    if (::rename(tmp_.c_str(), target_.c_str()) != 0) fail("cannot rename " + tmp_.string() + " to the target");
    committed_ = true;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw unirl::error("unirl: save_safetensors " + st_quote(target_.string(), 4096) + ": " + what + ": " + st_errno());
  }
  std::filesystem::path target_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

inline std::map<std::string, std::string> st_with_format(std::map<std::string, std::string> metadata) {
  metadata.emplace("format", "pt");  // transformers refuses safetensors files without it; kept if given
  return metadata;
}

inline void st_write_file(const std::filesystem::path& file, const std::vector<st_out_tensor>& layout,
                          const std::map<std::string, std::string>& metadata) {
  const auto header = st_header_bytes(layout, metadata);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  st_atomic_file out(file);
  out.write(len, 8);
  out.write(header.data(), header.size());
  for (const auto& t : layout) {
    if (t.nbytes == 0) continue;
    // One tensor at a time on the CPU, dense, row-major, conjugate/negative views resolved.
    auto c = t.tensor->detach();
    if (!c.device().is_cpu()) c = c.to(torch::kCPU);
    c = c.resolve_conj().resolve_neg().contiguous();
    if constexpr (std::endian::native != std::endian::little) {
      c = c.clone();
      st_swap_bytes(static_cast<unsigned char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()),
                    st_dtype_size(t.dtype));
    }
    out.write(c.data_ptr(), static_cast<std::size_t>(t.nbytes));
  }
  out.commit();
}

/// "model-00001-of-00003.safetensors" and the like (`stem` "model"; diffusers' components:
/// "diffusion_pytorch_model").
inline bool st_is_shard_name(const std::string& f, const std::string& stem = "model") {
  // <stem>-DDDDD-of-DDDDD.safetensors (5 or more digits each, as huggingface_hub's {:05d})
  const auto first = stem.size() + 1;
  if (f.rfind(stem + "-", 0) != 0 || f.size() < first + 26 || !f.ends_with(".safetensors")) return false;
  const auto mid = f.find("-of-", first);
  if (mid == std::string::npos) return false;
  auto digits = [&](std::size_t b, std::size_t e) {
    return e >= b + 5 && std::all_of(f.begin() + static_cast<std::ptrdiff_t>(b), f.begin() + static_cast<std::ptrdiff_t>(e),
                                     [](char c) { return c >= '0' && c <= '9'; });
  };
  return digits(first, mid) && digits(mid + 4, f.size() - 12);
}

}  // namespace detail

/// Writes `tensors` (any device, any strides) and `metadata` to `file`, replacing it atomically.
/// Tensors are laid out as the official writer does (descending dtype alignment, then name);
/// `metadata` gains "format": "pt" unless it has a "format" key (transformers requires one).
/// Throws `unirl::error` naming the tensor for a duplicate, reserved ("__metadata__"), undefined,
/// sparse or unsupported-dtype tensor, or a name or metadata string that is not UTF-8.
inline void save_safetensors(const std::filesystem::path& file,
                             const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  detail::st_write_file(file, detail::st_layout(tensors), detail::st_with_format(metadata));
}

/// Writes a Hugging Face checkpoint into `dir`: `model-00001-of-0000N.safetensors` ... (tensors
/// assigned in the given order, a new shard starting when the next tensor would take the current
/// one past `max_shard_bytes`; a larger tensor gets a shard of its own) and
/// `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}, written last,
/// formatted as huggingface_hub does); a single `model.safetensors` when everything fits.
/// `metadata` goes into every file (with "format": "pt"). Stale checkpoint files of another
/// layout in `dir` (model.safetensors, the index, model-*-of-*.safetensors) are removed afterwards.
/// `stem` names the files: "model" (transformers), "diffusion_pytorch_model" (diffusers).
inline void save_safetensors_sharded(const std::filesystem::path& dir,
                                     const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                     std::uint64_t max_shard_bytes,
                                     const std::map<std::string, std::string>& metadata = {},
                                     const std::string& stem = "model") {
  namespace fs = std::filesystem;
  UNIRL_CHECK(max_shard_bytes > 0, "save_safetensors_sharded: max_shard_bytes = ", max_shard_bytes, ": expected > 0");
  const auto all = detail::st_layout(tensors);  // validates every name and tensor before writing anything
  std::unordered_map<std::string, std::uint64_t> nbytes;
  for (const auto& t : all) nbytes.emplace(t.name, t.nbytes);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards;
  std::uint64_t cur = 0, total = 0;
  for (const auto& nt : tensors) {
    const auto n = nbytes.at(nt.first);
    if (shards.empty() || (!shards.back().empty() && cur + n > max_shard_bytes)) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(nt);
    cur += n;
    total += n;
  }
  if (shards.empty()) shards.emplace_back();
  const auto md = detail::st_with_format(metadata);
  std::unordered_set<std::string> written;
  const auto single = stem + ".safetensors", index_name = stem + ".safetensors.index.json";
  if (shards.size() == 1) {
    save_safetensors(dir / single, shards[0], md);
    written.insert(single);
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    for (std::size_t i = 0; i < shards.size(); ++i) {
      char suffix[64];
      std::snprintf(suffix, sizeof suffix, "-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      const auto name = stem + suffix;
      save_safetensors(dir / name, shards[i], md);
      written.insert(name);
      for (const auto& nt : shards[i]) weight_map[nt.first] = name;
    }
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
    const auto text = index.dump(2) + "\n";  // json.dumps(indent=2, sort_keys=True) + "\n"
    detail::st_atomic_file out(dir / index_name);
    out.write(text.data(), text.size());
    out.commit();
    written.insert(index_name);
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto f = e.path().filename().string();
    if (written.count(f)) continue;
    if (f == single || f == index_name || detail::st_is_shard_name(f, stem)) fs::remove(e.path(), ec);
  }
}

/// What `load_into` did: target names loaded, targets the checkpoint lacks (with
/// `allow_missing`), checkpoint tensors no target wanted (matched by `ignore_unexpected`).
struct load_report {
  std::vector<std::string> loaded, missing, unexpected;
};

struct load_options {
  bool allow_missing = false;                  // else a target absent from the checkpoint is an error
  std::vector<std::string> ignore_unexpected;  // substrings: checkpoint tensors no target wants that are fine
};

/// Copies checkpoint tensors into existing tensors (a module's named parameters and buffers),
/// converting dtype (bf16 file -> f32 parameter) and device, under NoGradGuard. Everything is
/// checked before anything is copied; a `format_error` lists every problem, each naming the
/// file, the tensor and what was expected: a target missing from the checkpoint, a checkpoint
/// tensor no target wants, a shape mismatch (both shapes), a floating <-> non-floating dtype
/// mismatch, a dtype LibTorch lacks. Duplicate target names are an `unirl::error`.
inline load_report load_into(const std::vector<std::pair<std::string, torch::Tensor>>& targets,
                             const safetensors_checkpoint& ckpt, const load_options& opt = {}) {
  using detail::st_quote;
  load_report report;
  std::unordered_set<std::string> wanted;
  std::vector<std::string> problems;
  std::vector<std::size_t> to_load;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto& [name, t] = targets[i];
    UNIRL_CHECK(wanted.insert(name).second, "load_into: the target name ", st_quote(name), " appears twice");
    UNIRL_CHECK(t.defined(), "load_into: target ", st_quote(name), " is undefined");
    if (!ckpt.contains(name)) {
      if (opt.allow_missing) report.missing.push_back(name);
      else problems.push_back("tensor " + st_quote(name) + ": missing from " + st_quote(ckpt.source().string(), 4096) +
                              " (expected by the target, shape " + detail::st_shape_string(t.sizes().vec()) + ")");
      continue;
    }
    const auto& e = ckpt.info(name);
    const auto where = "tensor " + st_quote(name) + " in " + st_quote(ckpt.file_of(name), 4096) + ": ";
    if (e.shape != t.sizes().vec()) {
      problems.push_back(where + "shape " + detail::st_shape_string(e.shape) + " in the checkpoint, but the target has " +
                         detail::st_shape_string(t.sizes().vec()));
      continue;
    }
    const bool target_float = at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type());
    if (st_dtype_is_floating(e.dtype) != target_float) {
      problems.push_back(where + "dtype " + st_dtype_name(e.dtype) + " in the checkpoint, but the target is " +
                         c10::toString(t.scalar_type()) + ": expected " +
                         (target_float ? "a floating-point" : "a non-floating-point") + " dtype");
      continue;
    }
    if (e.dtype != st_dtype::F64 && e.dtype != st_dtype::F32 && e.dtype != st_dtype::F16 &&
        e.dtype != st_dtype::BF16 && e.dtype != st_dtype::I64 && e.dtype != st_dtype::I32 &&
        e.dtype != st_dtype::I16 && e.dtype != st_dtype::I8 && e.dtype != st_dtype::U8 && e.dtype != st_dtype::BOOL) {
      problems.push_back(where + "dtype " + st_dtype_name(e.dtype) + " has no LibTorch tensor type");
      continue;
    }
    to_load.push_back(i);
  }
  for (const auto& name : ckpt.names()) {
    if (wanted.count(name)) continue;
    const bool ignored = std::any_of(opt.ignore_unexpected.begin(), opt.ignore_unexpected.end(),
                                     [&](const std::string& s) { return name.find(s) != std::string::npos; });
    if (ignored) report.unexpected.push_back(name);
    else problems.push_back("tensor " + st_quote(name) + " in " + st_quote(ckpt.file_of(name), 4096) +
                            ": no target wants it (unexpected; load_options::ignore_unexpected skips it)");
  }
  if (!problems.empty()) {
    std::string msg = "unirl: load_into from safetensors checkpoint " + st_quote(ckpt.source().string(), 4096) + ": " +
                      std::to_string(problems.size()) + (problems.size() == 1 ? " problem" : " problems");
    for (std::size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
    if (problems.size() > 20) msg += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
    throw format_error(msg);
  }
  torch::NoGradGuard no_grad;
  for (const auto i : to_load) {
    auto target = targets[i].second;
    target.copy_(ckpt.tensor(targets[i].first));
    report.loaded.push_back(targets[i].first);
  }
  return report;
}

}  // namespace unirl::io
