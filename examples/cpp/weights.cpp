#include "weights.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string_view>

#include "json.h"

namespace aotc {
namespace {

struct DType {
  const char* safetensors;
  const char* torch;
  c10::ScalarType type;
};

constexpr DType kDTypes[] = {
    {"F64", "float64", c10::kDouble}, {"F32", "float32", c10::kFloat},   {"F16", "float16", c10::kHalf},
    {"BF16", "bfloat16", c10::kBFloat16}, {"I64", "int64", c10::kLong}, {"I32", "int32", c10::kInt},
    {"I16", "int16", c10::kShort},   {"I8", "int8", c10::kChar},       {"U8", "uint8", c10::kByte},
    {"BOOL", "bool", c10::kBool},
};

const DType* by_safetensors(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.safetensors) return &d;
  return nullptr;
}

constexpr std::uint64_t kMaxHeader = 64ull << 20;  // as compiler/weightsfile.py caps it

struct FileClose {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

std::vector<std::int64_t> shape_of(const json::Value& v, const std::string& name) {
  if (!v.is_array()) throw Refused("weights header: " + name + " has no shape list");
  std::vector<std::int64_t> out;
  for (const auto& d : v.items) {
    std::uint64_t u;
    try {
      u = json::as_uint64(d, "weights header shape");
    } catch (const json::Error& e) {
      throw Refused(e.what());
    }
    if (u > std::uint64_t(INT64_MAX)) throw Refused("weights header: " + name + " has a dim above 2^63 - 1");
    out.push_back(std::int64_t(u));
  }
  return out;
}

}  // namespace

std::unordered_map<std::string, at::Tensor> load_weights(const std::string& path, const Expected& want,
                                                         c10::Device device) {
  std::unique_ptr<std::FILE, FileClose> f(std::fopen(path.c_str(), "rb"));
  if (!f) throw std::runtime_error("cannot open weights " + path);
  std::fseek(f.get(), 0, SEEK_END);
  const long end = std::ftell(f.get());
  std::fseek(f.get(), 0, SEEK_SET);
  if (end < 8) throw Refused("weights " + path + " are too short for a safetensors file");
  const std::uint64_t size = std::uint64_t(end);
  at::Tensor bytes = at::empty({std::int64_t(size)}, at::kByte);  // one allocation: the tensors are views of it
  if (std::fread(bytes.data_ptr(), 1, size, f.get()) != size) throw std::runtime_error("cannot read weights " + path);
  const auto* p = bytes.data_ptr<std::uint8_t>();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | p[i];
  if (n > kMaxHeader || n > size - 8) throw Refused("weights header claims " + std::to_string(n) + " bytes");
  json::Value header;
  try {
    header = json::parse(std::string_view(reinterpret_cast<const char*>(p + 8), n));
  } catch (const json::Error& e) {
    throw Refused(std::string("weights header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) throw Refused("weights header is not a JSON object");
  const std::uint64_t data_start = 8 + n, data_len = size - data_start;

  std::vector<Constant> constants = want.constants;
  if (constants.empty()) {  // unverified: everything the header lists, contiguous
    for (const auto& key : header.keys)
      if (key != "__metadata__") constants.push_back({key, "", {}, {}});
  }
  std::size_t listed = header.keys.size() - (header.find("__metadata__") ? 1 : 0);
  if (listed != constants.size())
    throw Refused("weights header lists " + std::to_string(listed) + " tensors; the manifest signs " +
                  std::to_string(constants.size()));

  std::unordered_map<std::string, at::Tensor> out;
  for (const auto& c : constants) {
    const json::Value* e = header.find(c.fqn);
    if (!e || !e->is_object()) throw Refused("weights header has no tensor " + c.fqn);
    const json::Value* dt = e->find("dtype");
    const DType* dtype = dt && dt->is_string() ? by_safetensors(dt->text) : nullptr;
    if (!dtype) throw Refused("weights header: " + c.fqn + " has an unknown dtype");
    if (!c.dtype.empty() && c.dtype != dtype->torch)
      throw Refused("weights header: " + c.fqn + " is " + dtype->torch + "; the manifest signs " + c.dtype);
    const json::Value* sh = e->find("shape");
    std::vector<std::int64_t> shape = shape_of(sh ? *sh : json::Value{}, c.fqn);
    if (!c.dtype.empty() && shape != c.shape) throw Refused("weights header: " + c.fqn + " has another shape");
    const json::Value* off = e->find("data_offsets");
    if (!off || !off->is_array() || off->items.size() != 2) throw Refused("weights header: " + c.fqn + " offsets");
    std::uint64_t b, en;
    try {
      b = json::as_uint64(off->items[0], "data offset");
      en = json::as_uint64(off->items[1], "data offset");
    } catch (const json::Error& err) {
      throw Refused(err.what());
    }
    // Checked products: wrapped around 2^64, a made-up shape could claim exactly the bytes its offsets span (an
    // unverified blob's header is anyone's; a verified one's constants are signed).
    std::uint64_t numel = 1, nbytes = 0;
    bool wrapped = false;
    for (auto d : shape) wrapped |= __builtin_mul_overflow(numel, std::uint64_t(d), &numel);
    const std::uint64_t elem = c10::elementSize(dtype->type);
    wrapped |= __builtin_mul_overflow(numel, elem, &nbytes);
    if (wrapped || numel > std::uint64_t(INT64_MAX))
      throw Refused("weights header: " + c.fqn + " has a shape whose size overflows");
    if (b > en || en > data_len || en - b != nbytes)
      throw Refused("weights header: " + c.fqn + " has bytes outside the file or of the wrong size");
    at::Tensor t = bytes.narrow(0, std::int64_t(data_start + b), std::int64_t(en - b));
    // The writer puts the widest elements first, so offsets are aligned; another writer's may not be: copy those.
    if ((data_start + b) % elem != 0) t = t.clone();
    t = t.view(dtype->type).reshape(shape);
    if (!c.stride.empty() && c.stride != t.strides().vec())
      t = at::empty_strided(shape, c.stride, t.options()).copy_(t);
    out.emplace(c.fqn, t.to(device));
  }
  return out;
}

}  // namespace aotc
