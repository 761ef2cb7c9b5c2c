// Fuzz-style test of train/checkpoint.hpp's reader (not libFuzzer: it needs LibTorch, built with
// the project's compiler). A real checkpoint (tensors of three dtypes, scalars, the CPU generator
// state) is written with write_checkpoint; then N corrupted copies are read back, each in a forked
// child so that a crash is counted rather than ending the test:
//   truncate  — cut at a random length (header or payload);
//   flip      — 1..8 random bytes set to random values anywhere in the file;
//   reseal    — payload bytes flipped / truncated / zeroed, then the header's size and FNV-1a
//               checksum recomputed, so the corruption reaches LibTorch's archive (zip) reader.
// Every case must end in success or unirl::checkpoint_error — never a crash, a hang, another
// exception type — and an accepted file that was not resealed must give back exactly the values
// written (the checksum guarantees it). Cases: $UNIRL_FUZZ_CASES (default 300), seed
// $UNIRL_FUZZ_SEED (default 1); the CTest entry fuzz.checkpoint runs the default.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>

#include <sys/wait.h>
#include <unistd.h>

#include <unirl/core/error.hpp>
#include <unirl/train/checkpoint.hpp>

namespace {
namespace fs = std::filesystem;
namespace tr = unirl::train;

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void spit(const std::string& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::int64_t env_int(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : fallback;
}

// Hand values, independent of the reader: what the original file holds.
torch::Tensor weight() { return torch::arange(12, torch::kFloat32).reshape({3, 4}) / 8; }
torch::Tensor counts() { return torch::tensor({std::int64_t{7}, std::int64_t{-1}, std::int64_t{1} << 40}, torch::kInt64); }
torch::Tensor mask() { return torch::tensor({true, false, true, true}); }

// Reads everything the trainer would; 0 when the values are the written ones, 1 otherwise.
int read_all(const std::string& path) {
  unirl::named_tensors into{{"w", torch::zeros({3, 4})},
                            {"n", torch::zeros({3}, torch::kInt64)},
                            {"m", torch::zeros({4}, torch::kBool)}};
  std::int64_t step = 0;
  double loss = 0;
  std::string note;
  tr::read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
    tr::load_tensors(a, "model/", into);
    step = tr::read_scalar<std::int64_t>(a, "step");
    loss = tr::read_scalar<double>(a, "loss");
    note = tr::read_scalar<std::string>(a, "note");
    tr::load_rng(a);
  });
  const bool same = torch::equal(into[0].second, weight()) && torch::equal(into[1].second, counts()) &&
                    torch::equal(into[2].second, mask()) && step == 42 && loss == 0.125 && note == "{\"lr\": 0.001}";
  return same ? 0 : 1;
}

void reseal(std::string& f) {
  const std::size_t n = f.size() - tr::checkpoint_header_size;
  for (int i = 0; i < 8; ++i) f[16 + i] = static_cast<char>((static_cast<std::uint64_t>(n) >> (8 * i)) & 0xff);
  const auto h = tr::detail::fnv1a64(f.data() + tr::checkpoint_header_size, n);
  for (int i = 0; i < 8; ++i) f[24 + i] = static_cast<char>((h >> (8 * i)) & 0xff);
}

// Exit codes of a child.
enum outcome : int { same = 0, accepted_different = 1, rejected = 3, other_exception = 4, unknown_exception = 5 };
}  // namespace

TEST_CASE("read_checkpoint rejects corrupted and truncated files with checkpoint_error, never a crash", "[fuzz][cpu]") {
  const auto dir = fs::temp_directory_path() / ("unirl_fuzz_checkpoint_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto good = (dir / "good.ckpt").string();
  tr::write_checkpoint(good, [&](torch::serialize::OutputArchive& a) {
    tr::save_tensors(a, "model/", {{"w", weight()}, {"n", counts()}, {"m", mask()}});
    tr::write_scalar(a, "step", std::int64_t{42});
    tr::write_scalar(a, "loss", 0.125);
    tr::write_scalar(a, "note", std::string("{\"lr\": 0.001}"));
    tr::save_rng(a);
  });
  REQUIRE(read_all(good) == same);
  const std::string original = slurp(good);
  REQUIRE(original.size() > tr::checkpoint_header_size + 64);

  const auto cases = env_int("UNIRL_FUZZ_CASES", 300);
  std::mt19937_64 rng(static_cast<std::uint64_t>(env_int("UNIRL_FUZZ_SEED", 1)));
  auto below = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  std::map<std::string, int> tally;
  int failures = 0;
  const auto path = (dir / "case.ckpt").string();
  for (std::int64_t c = 0; c < cases; ++c) {
    std::string f = original;
    std::string kind;
    bool resealed = false;
    const std::size_t body = f.size() - tr::checkpoint_header_size;
    switch (c % 5) {
      case 0: kind = "truncate"; f.resize(below(f.size())); break;
      case 1: {
        kind = "flip";
        const auto k = 1 + below(8);
        for (std::size_t i = 0; i < k; ++i) f[below(f.size())] = static_cast<char>(rng());
        break;
      }
      case 2: {
        kind = "reseal-flip";
        const auto k = 1 + below(8);
        for (std::size_t i = 0; i < k; ++i) f[tr::checkpoint_header_size + below(body)] = static_cast<char>(rng());
        resealed = true;
        break;
      }
      case 3: kind = "reseal-truncate"; f.resize(tr::checkpoint_header_size + below(body)); resealed = true; break;
      default: {
        kind = "reseal-zero-range";
        const auto at = below(body), len = 1 + below(std::min<std::size_t>(256, body - at));
        std::fill_n(f.begin() + static_cast<std::ptrdiff_t>(tr::checkpoint_header_size + at), len, '\0');
        resealed = true;
      }
    }
    if (resealed) reseal(f);
    spit(path, f);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int code = unknown_exception;
      try {
        code = read_all(path);
      } catch (const unirl::checkpoint_error&) {
        code = rejected;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "case %lld (%s): %s\n", static_cast<long long>(c), kind.c_str(), e.what());
        code = other_exception;
      } catch (...) {
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    std::string result;
    bool ok = false;
    if (WIFSIGNALED(status)) {
      result = "crash (signal " + std::to_string(WTERMSIG(status)) + ")";
    } else {
      const int code = WEXITSTATUS(status);
      result = code == same ? "accepted" : code == rejected ? "checkpoint_error"
             : code == accepted_different ? "accepted with different values" : "exception " + std::to_string(code);
      ok = code == rejected || code == same || (code == accepted_different && resealed);
    }
    ++tally[kind + ": " + result];
    if (!ok) {
      ++failures;
      const auto keep = (dir / ("failure_" + std::to_string(c) + ".ckpt")).string();
      spit(keep, f);
      UNSCOPED_INFO("case " << c << " (" << kind << "): " << result << "; file kept as " << keep);
    }
  }
  for (const auto& [k, n] : tally) std::printf("checkpoint fuzz: %-45s %d\n", k.c_str(), n);
  std::printf("checkpoint fuzz: %lld cases, %d failures\n", static_cast<long long>(cases), failures);
  CHECK(failures == 0);
  if (failures == 0) fs::remove_all(dir);
}
