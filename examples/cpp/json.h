// A small, strict JSON parser (RFC 8259) for the signed manifest, so the example needs nothing beyond libtorch and
// OpenSSL. Strict on purpose: a verifier that reads a document differently from the signer is a way around the
// signature, so anything unusual is an error rather than a guess:
//   - duplicate keys in an object (Python's json keeps the last one; a lenient C++ parser might keep the first),
//   - invalid UTF-8, unescaped control characters, lone surrogates in \u escapes,
//   - numbers outside the JSON grammar (leading zeros, "+1", ".5", NaN), trailing bytes, nesting deeper than 64.
// Numbers keep their literal text; callers convert the ones they need (see as_uint64).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace aotc::json {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value {
  enum class Type { Null, Bool, Number, String, Array, Object };

  Type type = Type::Null;
  bool boolean = false;
  std::string text;                // a string's decoded UTF-8, or a number's literal
  std::vector<Value> items;        // an array's elements, or an object's values
  std::vector<std::string> keys;   // an object's keys, in document order, unique

  bool is_object() const { return type == Type::Object; }
  bool is_array() const { return type == Type::Array; }
  bool is_string() const { return type == Type::String; }

  // The member `key` of an object, or nullptr when absent (or when this is not an object).
  const Value* find(std::string_view key) const;
};

// Parses a whole document; throws Error naming the byte offset of the first problem.
Value parse(std::string_view text);

// A number that is a plain non-negative integer literal ("0", "1645042") that fits in 64 bits; throws otherwise.
std::uint64_t as_uint64(const Value& v, std::string_view what);

}  // namespace aotc::json
